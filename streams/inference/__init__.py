"""The caller's side of the inference protocol (streams/wire.py): publishing
requests and cancels (client.py), reading a request's frames with the waiting
rule (frames.py), and folding streamed tool-call deltas (tool_calls.py). The
gateway's dispatch and coalescing and the agent's model calls all use it."""
