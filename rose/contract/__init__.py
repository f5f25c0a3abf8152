"""The contract in code: typed events (`events`), their bytes on the wire (`wire`), their signatures
(`signing`)."""
