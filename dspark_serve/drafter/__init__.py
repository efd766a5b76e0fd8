"""DSpark drafter (paper Section 3.1, Eq 2-7): DFlash parallel backbone, Markov/RNN sequential
head, confidence head, per-slot context cache, DeepSpec/DFlash checkpoints."""
from dspark_serve.drafter.checkpoint import load_drafter, read_config, save_drafter
from dspark_serve.drafter.config import DSparkConfig
from dspark_serve.drafter.context_cache import DraftContextCache
from dspark_serve.drafter.model import DSparkDrafter

__all__ = ["DSparkConfig", "DSparkDrafter", "DraftContextCache", "load_drafter", "read_config",
           "save_drafter"]
