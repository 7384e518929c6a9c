"""A ``cpu`` platform for verl 0.9.1, registered through verl's own platform registry.

verl has no CPU platform: with no accelerator it falls back to ``nvidia`` and asks for NCCL.
This one answers for the CPU: gloo for collectives, no device memory, the CPU's random state.
Its Ray resource is "GPU" because verl's resource pools count only GPUs (or NPUs); the CPU
config asks Ray for one such resource (``ray_kwargs.ray_init.num_gpus=1``).
"""

from __future__ import annotations

import contextlib
import types

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry


def _nothing(*args, **kwargs):
    return None


#: What verl calls on ``get_torch_device()``. ``device_count`` is 0 so that verl's
#: ``set_random_seed`` skips Megatron's CUDA random-state tracker.
DEVICE_MODULE = types.SimpleNamespace(
    current_device=lambda: "cpu", device_count=lambda: 0, set_device=_nothing, synchronize=_nothing,
    is_available=lambda: True, empty_cache=_nothing, ipc_collect=_nothing, memory_allocated=lambda *a: 0,
    memory_reserved=lambda *a: 0, max_memory_allocated=lambda *a: 0, max_memory_reserved=lambda *a: 0,
    mem_get_info=lambda *a: (1 << 34, 1 << 34), set_per_process_memory_fraction=_nothing,
    reset_peak_memory_stats=_nothing, get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state,
    manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, get_device_name=lambda *a: "cpu",
    Stream=torch.cpu.Stream, stream=torch.cpu.stream, current_stream=torch.cpu.current_stream, Event=torch.cpu.Event,
)


@PlatformRegistry.register(platform="cpu")
class CpuPlatform(PlatformBase):
    @property
    def device_name(self):
        return "cpu"

    @property
    def vendor_name(self):
        return "cpu"

    @property
    def device_module(self):
        return DEVICE_MODULE

    def is_available(self):
        return True

    def is_platform_available(self, use_smi_check=False):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg):
        return contextlib.nullcontext()

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "GPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None
