"""ejkfn: a functional, pytree-first kernel library for JAX.

Kernels are equinox Modules with a static config; selecting a config is a pure function of an
invocation and an immutable cache state; transforms (custom VJP, mapping, labels, recording) are
higher-order functions.
"""

__version__ = "0.1.0"

from . import testing as testing
from ._ambient import current_session as current_session
from ._ambient import default_caches as default_caches
from ._ambient import forward_autotune_only as forward_autotune_only
from ._ambient import overlay_cache as overlay_cache
from ._ambient import policy_override as policy_override
from ._ambient import use_caches as use_caches
from ._batch import pmap_with_config as pmap_with_config
from ._batch import shard_map_with_config as shard_map_with_config
from ._batch import vmap_with_config as vmap_with_config
from ._cache import Caches as Caches
from ._cache import ConfigCache as ConfigCache
from ._compile import compile as compile
from ._compile import configure_tree as configure_tree
from ._invocation import Invocation as Invocation
from ._kernel import Kernel as Kernel
from ._labels import Label as Label
from ._labels import extract_labels_from_hlo_text as extract_labels_from_hlo_text
from ._labels import find_labels_in_lowered as find_labels_in_lowered
from ._labels import label as label
from ._labels import labels_to_configs as labels_to_configs
from ._labels import stamping as stamping
from ._offline import AutotuningResult as AutotuningResult
from ._offline import autotune_lowered as autotune_lowered
from ._offline import autotune_recorded as autotune_recorded
from ._persistent import CacheCorruptionWarning as CacheCorruptionWarning
from ._persistent import PersistentCache as PersistentCache
from ._persistent import default_cache_dir as default_cache_dir
from ._platform import device_fingerprint as device_fingerprint
from ._platform import device_kind as device_kind
from ._platform import get_device_platform as get_device_platform
from ._platform import sharding_fingerprint as sharding_fingerprint
from ._platform import software_versions as software_versions
from ._policy import AutotunePolicy as AutotunePolicy
from ._record import Recorder as Recorder
from ._record import clear_recorded as clear_recorded
from ._record import get_invocations as get_invocations
from ._record import record as record
from ._record import recording as recording
from ._registry import BwdParams as BwdParams
from ._registry import FwdParams as FwdParams
from ._registry import KernelConfig as KernelConfig
from ._registry import Platform as Platform
from ._registry import available_platforms as available_platforms
from ._registry import detect_platform as detect_platform
from ._registry import get_kernel as get_kernel
from ._registry import register_kernel as register_kernel
from ._select import Decision as Decision
from ._select import NoConfigError as NoConfigError
from ._select import choose_config as choose_config
from ._select import configure as configure
from ._select import decide as decide
from ._select import select as select
from ._serialize import from_json as from_json
from ._serialize import stable_json as stable_json
from ._serialize import to_json as to_json
from ._tune import CandidateResult as CandidateResult
from ._tune import Tuner as Tuner
from ._tune import TuneReport as TuneReport
from ._tune import autotune as autotune
from ._tune import benchmark as benchmark
from ._tune import interleaved_seconds as interleaved_seconds
from ._vjp import custom_vjp as custom_vjp
from .attention import AttentionConfig as AttentionConfig
from .attention import FlashAttention as FlashAttention
from .attention import flash_attention as flash_attention
from .attention import ring_attention as ring_attention
from .attention import ring_attention_sharded as ring_attention_sharded
from .attention import zigzag_order as zigzag_order
