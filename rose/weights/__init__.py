"""The weight transfer engine: sharded, sparse, bit-exact weight deltas.

Pure parts (no I/O, numpy only): `layout` (the canonical flat layout and its shards), `scan`
(finding and writing a shard's changed elements: numpy kernels, torch kernels for device
tensors), `codec` (shard patches, lossless by default), `zdelta` (the default lossless body:
entropy-coded gaps and differences), `xor_delta` (the XOR body of format 2, still decoded; the
lossy codecs' body), `lossy` (opt-in top-k / int8 with error feedback), `delta_file` (the `rose
weights diff` file format), `entries` (the Redis entry wire format and its HMAC). Adapters:
`checkpoint` (safetensors/torch files; torch imported lazily), `stream` (the Redis Streams
publisher) and `follower` (the exactly-once receiver).
"""
