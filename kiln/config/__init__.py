"""The config: Hydra composes `conf/`, pydantic validates the result, one module per group.

Hydra gives us groups and command-line overrides; pydantic gives us types and the refusal of unknown
keys. A mistyped key fails with the dotted key and the conf file (or override) it came from.

  base      the strict model, shared bounds, PairError       data      curation stages, stand-ins
  model     the DiT                                          train     one training stage
  cluster   where jobs run                                   metrics   distribution metrics
  post      post-training                                    expander  the prompt expander
  ladder    the training ladder                              style     style-reference training
  schema    KilnConfig, the whole config                     compose   load_config: compose, validate, explain

Everything is importable from `kiln.config` itself, as before the split.
"""

from kiln.config.base import (
    MAX_BATCH,
    MAX_ROWS,
    MAX_SIDE,
    MAX_STEPS,
    MAX_THREADS,
    MAX_TOKENS,
    SEED_MAX,
    PairError,
    Seed,
    Strict,
    check_order,
)
from kiln.config.cluster import ClusterConfig
from kiln.config.compose import (
    GROUPS,
    ConfigError,
    compose_raw,
    conf_dir,
    error_keys,
    load_config,
    model_problems,
    stage_overrides,
    to_yaml,
    validate,
)
from kiln.config.data import (
    STAND_INS,
    CaptionConfig,
    CaptionForm,
    Chars,
    ClassifyConfig,
    ClusteringConfig,
    ConceptConfig,
    DataConfig,
    DedupConfig,
    DemoConfig,
    DomainMix,
    EmbedConfig,
    FilterConfig,
    HeadConfig,
    IngestConfig,
    MixConfig,
    MixPart,
    OCRConfig,
    PackConfig,
    RewriteConfig,
    SAEConfig,
    UserPromptConfig,
    UserPromptStyle,
    VLMLabellerConfig,
)
from kiln.config.expander import ExpanderConfig
from kiln.config.ladder import DomainRungConfig, LadderConfig, RungConfig
from kiln.config.metrics import MetricsConfig
from kiln.config.model import ModelConfig, ReferenceConfig, TextEncoderConfig
from kiln.config.post import MergeCandidate, MergeConfig, MergeWeight, PostConfig, RewardSpec, TDMConfig
from kiln.config.schema import KilnConfig
from kiln.config.style import StyleConfig
from kiln.config.train import (
    DCPConfig,
    EvalConfig,
    OptimConfig,
    ParallelConfig,
    RepaConfig,
    RouteConfig,
    SampleConfig,
    TelemetryConfig,
    TrainConfig,
)

__all__ = [
    "Strict",
    "SEED_MAX",
    "MAX_SIDE",
    "MAX_STEPS",
    "MAX_ROWS",
    "MAX_BATCH",
    "MAX_THREADS",
    "MAX_TOKENS",
    "Seed",
    "PairError",
    "check_order",
    "DemoConfig",
    "IngestConfig",
    "FilterConfig",
    "DedupConfig",
    "CaptionConfig",
    "OCRConfig",
    "CaptionForm",
    "Chars",
    "RewriteConfig",
    "MixPart",
    "DomainMix",
    "MixConfig",
    "ConceptConfig",
    "PackConfig",
    "EmbedConfig",
    "VLMLabellerConfig",
    "HeadConfig",
    "ClassifyConfig",
    "SAEConfig",
    "ClusteringConfig",
    "STAND_INS",
    "UserPromptStyle",
    "UserPromptConfig",
    "DataConfig",
    "TextEncoderConfig",
    "ReferenceConfig",
    "ModelConfig",
    "SampleConfig",
    "EvalConfig",
    "ParallelConfig",
    "OptimConfig",
    "RepaConfig",
    "RouteConfig",
    "DCPConfig",
    "TelemetryConfig",
    "TrainConfig",
    "ClusterConfig",
    "MetricsConfig",
    "RewardSpec",
    "TDMConfig",
    "MergeWeight",
    "MergeCandidate",
    "MergeConfig",
    "PostConfig",
    "ExpanderConfig",
    "RungConfig",
    "DomainRungConfig",
    "LadderConfig",
    "StyleConfig",
    "KilnConfig",
    "ConfigError",
    "GROUPS",
    "conf_dir",
    "compose_raw",
    "model_problems",
    "error_keys",
    "validate",
    "stage_overrides",
    "load_config",
    "to_yaml",
]
