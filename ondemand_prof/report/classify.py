"""Names and vocabularies of the trace formats we read: event categories across Kineto versions, the
communication libraries' kernels and operators, and device names as users write them.

Communication is recognised by what each library is known to emit (COMM_LIBRARIES: one entry per library, the
patterns taken from the libraries' sources and from public traces), anchored at the start of the name, never by
a substring: `BroadcastTo` (an Ascend vector op), `aten::broadcast_tensors`, DeepEP's layout kernel
`get_dispatch_layout` and the CUB scans in DeepSeek's `cdpsk::ep::` namespace are compute.
"""

from __future__ import annotations

import functools
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
# torch_npu's device tasks known only by their type (the db's TASK rows without compute or HCCL info, named by their
# taskType; the text export's "Ascend Hardware" rows of the same names): synchronisation and async copies. Listed in
# the kernel tables, counted in neither compute nor communication, as torch_npu's own split (Computing) leaves them
# out: an EVENT_WAIT that lasts an allreduce is a stream waiting, not work.
# The tasks of an hcom_ operation, as torch_npu names them (its HCCL process in trace_view.json, the taskType of
# COMMUNICATION_TASK_INFO in the db): HCCL's task types SDMA (Memcpy), RDMA (RDMASend), REDUCE_INLINE, REDUCE_TBE,
# NOTIFY_RECORD, NOTIFY_WAIT (CANN's hccl dispatcher task types)
HCCL_TASKS = frozenset({"Notify_Wait", "Notify_Record", "Reduce_Inline", "Reduce_TBE", "Memcpy", "RDMASend"})
NPU_LISTED_TASKS = frozenset({"EVENT_WAIT", "EVENT_RECORD", "MEMCPY_ASYNC", "PROFILING_ENABLE", "PROFILING_DISABLE"})

_V = r"(?:void )?"  # Kineto writes a CUDA kernel's demangled signature: `void ns::kernel<...>(args)`
# library -> what it emits (device kernels, CPU operators, record_function ranges), matched at the name's start
COMM_LIBRARIES: dict[str, str] = {
    # ncclDevKernel_AllReduce_Sum_f32_RING_LL, ncclKernel_* (older NCCL, RCCL), ncclSymk* (NCCL 2.27 symmetric
    # kernels), the nccl:all_reduce ranges ProcessGroupNCCL records
    "NCCL/RCCL": _V + r"(?:nccl|rccl)",
    # hcom_allReduce__885_0_1 (kernels), HcclAllReduce (API), hccl:... ranges; the tasks of an hcom_ operation as
    # torch_npu names them (HCCL_TASKS), whole names only ("Memcpy" alone is HCCL's; CUDA's are "Memcpy HtoD ...")
    "HCCL": r"hcom_|hccl[:_]|Hccl[A-Z]|(?:Notify_Wait|Notify_Record|Reduce_Inline|Reduce_TBE|Memcpy|RDMASend)$",
    # ProcessGroupGloo's ranges: gloo:all_reduce, gloo:broadcast ...
    "gloo": r"gloo:",
    # torch.distributed's operators: c10d::allreduce_, _c10d_functional::all_reduce and ::wait_tensor (the wait for
    # one), their autograd variants, record_param_comms (around every collective), ProcessGroupNCCL::allreduce
    # (older torch)
    "c10d": r"_?c10d(?:_functional(?:_autograd)?)?::(?!symmetric_memory::|nvshmem_extension::)"
            r"|record_param_comms$|ProcessGroup[A-Za-z]*::",
    # DeepEP's expert-parallel all-to-all: deep_ep::intranode::dispatch<8, 768, 8192>(...), ::combine,
    # ::notify_dispatch, ::cached_notify_combine, internode::cached_notify, internode_ll:: (low latency), the
    # same under deep_ep::legacy:: (DeepEP V2), V2's deep_ep::elastic::dispatch_impl / combine_impl / barrier_impl
    # / pp_send_impl / engram_fetch_impl, and DeepSeek's own dpsk::ep::internode:: (its published training
    # trace). Not deep_ep::layout:: / dpsk::ep::cuda::get_dispatch_layout (routing arithmetic, no transfer).
    "DeepEP": _V + r"(?:deep_ep::(?:legacy::)?|dpsk::ep::)(?:intranode|internode|internode_ll)::"
              r"|" + _V + r"deep_ep::elastic::(?:hybrid_)?(?:dispatch_impl|combine_impl|barrier_impl|pp_send_impl"
              r"|pp_recv_impl|engram_fetch\w*_impl)\b",
    # NVSHMEM's own kernels: nvshmemi_reduce_kernel<...>, nvshmemi_proxy_quiet_entrypoint, *_on_stream_kernel
    "NVSHMEM": _V + r"nvshmem[ix]?_",
    # torch SymmetricMemory (torch.ops.symm_mem): its operators, its kernels (anonymous namespace in
    # CUDASymmetricMemoryOps.cu: multimem_all_reduce_kernel, one_shot_/two_shot_all_reduce_kernel[_inplace],
    # multimem_all_gather_kernel ...), c10d::symmetric_memory:: barriers and signals, the NVSHMEM backend's
    # c10d::nvshmem_extension:: all-to-all
    "SymmetricMemory": r"symm_mem::"
                       r"|" + _V + r"\(anonymous namespace\)::(?:multimem|one_shot|two_shot)_\w*"
                       r"(?:all_reduce|all_gather|reduce|reduce_scatter)\w*_kernel"
                       r"|" + _V + r"c10d::(?:symmetric_memory|nvshmem_extension)::",
    # MSCCL++: mscclpp::executionKernel<...> and mscclpp::collective::allreduceRsAg<...> (its NCCL-compatible
    # collectives), and the older apps/nccl kernels in the global namespace (allreduce7<...>, allgather6, ...),
    # told apart by their parameters: MSCCL++ channel handles (mscclpp::DeviceHandle<mscclpp::MemoryChannel>*)
    "MSCCL++": _V + r"mscclpp::|" + _V + r"[A-Za-z_]\w*(?:<[^()]*>)?\([^()]*mscclpp::DeviceHandle<",
}
_COMM_RE = [(library, re.compile(pattern)) for library, pattern in COMM_LIBRARIES.items()]

# torch_npu's kernel_details.csv / op_statistic.csv core types of communication tasks
COMM_CORE_TYPES = frozenset({"HCCL", "COMMUNICATION"})
# per-call suffix HCCL puts on a kernel name: hcom_allReduce__885_0_1 -> hcom_allReduce_
_HCOM_SUFFIX = re.compile(r"^(hcom_[A-Za-z]+_)_\d+(?:_\d+)*$")

# a rank in a file or directory name (worker_rank3.json, rank-1.pt.trace.json)
RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)

# c10::DeviceType values that appear in [memory] events
DEVICE_TYPES = {0: "CPU", 1: "cuda", 2: "mkldnn", 6: "hip", 9: "xla", 12: "xpu", 13: "mps", 15: "hpu", 19: "mtia",
                20: "npu"}


@functools.lru_cache(maxsize=1 << 16)  # a trace repeats a few thousand names millions of times
def comm_library(name: str) -> str | None:
    """The communication library a kernel, operator or range belongs to (a COMM_LIBRARIES key), or None."""
    for library, pattern in _COMM_RE:
        if pattern.match(name):
            return library
    return None


# What a collective does, from the names libraries give it (the part after the library's prefix, case and
# separators ignored); the first that matches wins, so reduce_scatter is not read as reduce, nor all_gather as gather.
COLLECTIVE_KINDS: tuple[tuple[str, str], ...] = (
    ("reduce_scatter", r"reduce_?scatter"),
    ("all_reduce", r"all_?reduce"),
    ("all_gather", r"all_?gather"),
    ("all_to_all", r"all_?to_?all|dispatch|combine|(?:^|_)a2a"),  # DeepEP's dispatch/combine are all-to-all
    ("broadcast", r"broadcast|bcast"),
    ("barrier", r"barrier"),
    # point-to-point: one direction where the name says one (c10d::send, c10d::recv_, gloo:send, nccl:recv), both
    # where one call does both (NCCL's SendRecv kernel, a p2p range)
    ("send/recv", r"send.*recv|recv.*send|p2p"),
    ("send", r"send"),
    ("recv", r"recv"),
    ("reduce", r"reduce"),
    ("gather", r"gather"),
    ("scatter", r"scatter"),
    ("wait", r"wait"),
)
_KIND_RE = [(kind, re.compile(pattern)) for kind, pattern in COLLECTIVE_KINDS]
# point-to-point kinds: pairs of ranks, not groups (timeline.py leaves them out of the matching across ranks)
P2P_KINDS = frozenset({"send", "recv", "send/recv"})
# libraries that run the transfer (their ranges and kernels are the collective's time); c10d's operators only
# issue one (an enqueue on the training thread, around which a backend range runs on a worker thread or device)
BACKEND_LIBRARIES = frozenset({"NCCL/RCCL", "HCCL", "gloo", "DeepEP", "NVSHMEM", "SymmetricMemory", "MSCCL++"})


@functools.lru_cache(maxsize=1 << 14)
def collective_kind(name: str) -> str:
    """all_reduce, reduce_scatter, all_gather, all_to_all, broadcast, barrier, send, recv, send/recv (a call that
    does both), reduce, gather, scatter, wait, or "other", from a communication kernel's, operator's or range's name
    (`ncclDevKernel_ReduceScatter_Sum_f32_RING_LL` -> reduce_scatter, `c10d::_allgather_base_` -> all_gather,
    `gloo:all_reduce` -> all_reduce, `hcom_allReduce_` -> all_reduce)."""
    text = re.sub(r"^void ", "", name)
    text = text.split("<", 1)[0].split("(", 1)[0].lower()
    for prefix in ("_c10d_functional_autograd::", "_c10d_functional::", "c10d::", "gloo:", "nccl:", "hccl:"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    for kind, pattern in _KIND_RE:
        if pattern.search(text):
            return kind
    return "other"


def is_comm(name: str) -> bool:
    """A collective, point-to-point or all-to-all kernel, operator or range of a known communication library."""
    return comm_library(name) is not None


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


# ----------------------------------------------------------------------------------------------------------
# Names as a table cell shows them (the text and HTML reports, and the cause line of a comparison)

def short_name(name: str, n: int = 60) -> str:
    """A kernel or operator name that fits a table cell: the parameter list of a C++ signature is folded
    (`void at::native::elementwise_kernel<128, 4, F>(int, F)` -> `at::native::elementwise_kernel<128, 4, F>(…)`),
    then the middle is cut, so that the template arguments that tell kernels apart keep their start and end. The
    full name stays in the JSON and in the HTML's hover text."""
    text = re.sub(r"^void ", "", name.strip())
    if len(text) > n and text.endswith(")"):
        text = _fold_params(text)
    if len(text) <= n:
        return text
    keep = n - 1
    return text[: keep - keep // 3] + "…" + text[len(text) - keep // 3:]


def _fold_params(text: str) -> str:
    """`f<T>(int, T)` -> `f<T>(…)`: the last balanced (...) at the end of the name (unbalanced: unchanged)."""
    depth = 0
    for i in range(len(text) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(text[i], 0)
        if depth == 0:
            return text[:i] + "(…)" if i > 0 else text
    return text
