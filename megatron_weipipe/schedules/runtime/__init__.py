"""torch.distributed, model-agnostic: the WeiPipe ring runtime (ring.py) that executes one
rank's action list with real tensors, and flat chunk buffers (flat.py)."""
