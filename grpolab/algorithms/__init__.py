"""The training methods, one file each (``<method>.py``, with ``<method>_*.py`` helpers private to
it): the file opens with the method's ``Config`` and ends with its ``train_<method>``. ``METHODS``
names them for the command line (``training.method.Method``), which imports a method only when it runs it."""

from ..training.method import Method

METHODS = {
    "grpo": Method("grpolab.algorithms.grpo", "GRPOConfig", "train_grpo",
                   "Train with GRPO (CS336 Algorithm 3). Any config field can follow as --field value."),
    "sft": Method("grpolab.algorithms.sft", "SFTConfig", "train_sft",
                  "Supervised fine-tuning on (prompt, response) pairs, loss on the response only."),
    "ei": Method("grpolab.algorithms.expert_iteration", "EIConfig", "train_expert_iteration",
                 "Expert iteration (CS336 Algorithm 2): sample, keep verified-correct responses, SFT on them."),
    "ppo": Method("grpolab.algorithms.ppo", "PPOConfig", "train_ppo",
                  "PPO with a value head and GAE (the RLHF baseline GRPO is measured against)."),
    "dpo": Method("grpolab.algorithms.dpo", "DPOConfig", "train_dpo",
                  "DPO on preference pairs; reports held-out preference accuracy."),
    "rm": Method("grpolab.algorithms.rm", "RMConfig", "train_rm",
                 "Train a reward model (Bradley-Terry) on preference pairs; reports held-out pairwise accuracy."),
    "distill": Method("grpolab.algorithms.distill", "DistillConfig", "train_distill",
                      "On-policy distillation: the student samples, a teacher's per-token log-probs are its signal."),
}
