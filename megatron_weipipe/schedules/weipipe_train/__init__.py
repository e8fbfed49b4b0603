"""WeiPipe schedules that train the real GPT model of pretrain_gpt.py.

`ring_model` turns one GPTModel per ring rank into an owned decoder chunk plus ring
replicas of the embedding / final norm / output layer; `steps` turns Megatron-style
forward steps into the runtime's pre/post functions; `schedule` is the TrainSchedule
(`--pipeline-schedule weipipe-naive | weipipe-interleave | weipipe-zb`).
"""

from .schedule import WeiPipeInterleave, WeiPipeNaive, WeiPipeSchedule, WeiPipeZeroBubble

__all__ = ["WeiPipeInterleave", "WeiPipeNaive", "WeiPipeSchedule", "WeiPipeZeroBubble"]
