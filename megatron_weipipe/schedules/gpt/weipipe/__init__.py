"""The WeiPipe schedule that trains the real GPT model of pretrain_gpt.py.

`ring_model` turns one GPTModel per ring rank into an owned decoder chunk plus ring
replicas of the embedding / final norm / output layer; `steps` turns Megatron-style
forward steps into the runtime's pre/post functions; `schedule` is the TrainSchedule of
every `--pipeline-schedule weipipe-*` variant (the variant picks only the plan).
"""

from megatron_weipipe.schedules.gpt.weipipe.schedule import WeiPipeSchedule

__all__ = ["WeiPipeSchedule"]
