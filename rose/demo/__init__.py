"""`rose demo`: the whole system end to end on the local stack, with a live view and a report.

What runs (rose.demo.orchestrator starts and stops every process):

* trace-driven serving nodes `sim/0..N-1` (`rose agent --simulate`, rose.serving_model: their
  latency is a model of an LLM engine, not a measurement);
* one real co-served device `real/0` (rose.demo.coserve): a small torch transformer answering
  requests replayed from the same trace on this machine's CPU (CUDA when present), its TTFT
  and TPOT measured by wall clock around the forward passes;
* the lease scheduler (`rose scheduler`) and executors for both kinds of GPU
  (rose.demo.executor_node: `rose.executor.service.Executor` whose workers follow the trainer's
  weights), a dedicated rollout worker that is always on;
* a trainer (rose.demo.trainer) closing the RL loop: REINFORCE on the collected trajectories,
  weight deltas through Redis after every optimizer step.

Every run uses its own Kafka topic prefix (`rose.demo-<run>.`) and Redis key prefix
(`rose:demo-<run>:`), created at start and deleted at the end, so a demo never touches a live
system's topics and never sees a previous run's state.
"""
