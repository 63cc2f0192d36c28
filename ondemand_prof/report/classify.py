"""Names and vocabularies of the trace formats we read: event categories across Kineto versions, the collective
kernels and operators of NCCL/RCCL, HCCL (hcom), gloo and c10d, and device names as users write them.

Communication is recognised by what the libraries are known to emit, anchored at the start of the name, never by
a substring: `BroadcastTo` (an Ascend vector op) and `aten::broadcast_tensors` are compute.
"""

from __future__ import annotations

import re
from typing import Any

# Kineto before torch 1.11 named the categories differently; map them onto today's.
CATEGORY_ALIASES = {"Operator": "cpu_op", "Kernel": "kernel", "Memcpy": "gpu_memcpy", "Memset": "gpu_memset",
                    "Runtime": "cuda_runtime", "Driver": "cuda_driver", "User": "user_annotation"}
# CPU-side events that launch device work and carry the launch's correlation id (CUDA and HIP runtime/driver).
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})
# torch_npu's trace_view.json puts device tasks (no "cat") under these processes; HCCL's are all communication.
DEVICE_PROCESSES = {"Ascend Hardware": False, "HCCL": True}
# ... and links each to the operator that launched it by a flow of this category (start: the op, finish: the task)
LAUNCH_FLOWS = frozenset({"async_npu"})

_COMM = re.compile(
    r"(?:void )?(?:nccl|rccl)"           # NCCL/RCCL kernels (ncclDevKernel_*, ncclKernel_*) and ProcessGroupNCCL ranges
    r"|hcom_|hccl[:_]|Hccl[A-Z]"         # HCCL kernels (hcom_allReduce_*), ranges and API calls (HcclAllReduce)
    r"|gloo:"                            # ProcessGroupGloo ranges (gloo:all_reduce)
    r"|_?c10d(?:_functional)?::"         # c10d ops (c10d::allreduce_) and functional collectives
    r"|record_param_comms$"              # torch's annotation around every collective
    r"|ProcessGroup[A-Za-z]*::",         # ProcessGroupNCCL::allreduce and friends (older torch)
    re.IGNORECASE)
# torch_npu's kernel_details.csv / op_statistic.csv core types of communication tasks
COMM_CORE_TYPES = frozenset({"HCCL", "COMMUNICATION"})
# per-call suffix HCCL puts on a kernel name: hcom_allReduce__885_0_1 -> hcom_allReduce_
_HCOM_SUFFIX = re.compile(r"^(hcom_[A-Za-z]+_)_\d+(?:_\d+)*$")

# a rank in a file or directory name (worker_rank3.json, rank-1.pt.trace.json)
RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)

# c10::DeviceType values that appear in [memory] events
DEVICE_TYPES = {0: "CPU", 1: "cuda", 2: "mkldnn", 6: "hip", 9: "xla", 12: "xpu", 13: "mps", 15: "hpu", 19: "mtia",
                20: "npu"}


def is_comm(name: str) -> bool:
    """A collective (or point-to-point) kernel, operator or range of a known communication library."""
    return _COMM.match(name) is not None


def kernel_group(name: str) -> str:
    """The name under which a device kernel is aggregated: HCCL's per-call numbering is dropped."""
    m = _HCOM_SUFFIX.match(name)
    return m.group(1) if m else name


def device_name(device_type: Any, device_id: Any) -> str:
    """`CPU`, `cuda:0`, `npu:1` from c10::DeviceType numbers; a name already written out (`NPU:0`) is kept."""
    if isinstance(device_type, str) and not device_type.lstrip("-").isdigit():
        return device_type
    try:
        dtype = int(device_type)
    except (TypeError, ValueError):
        return "unknown"
    kind = DEVICE_TYPES.get(dtype, f"device{dtype}")
    if kind == "CPU":
        return kind
    try:
        index = int(device_id)
    except (TypeError, ValueError):
        return kind
    return kind if index < 0 else f"{kind}:{index}"
