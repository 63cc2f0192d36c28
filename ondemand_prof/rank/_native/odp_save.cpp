// ondemand_prof's GIL-free trace save (rank/native_save.py builds and loads it; README "Output").
//
// torch binds ProfilerResult.save() (behind export_chrome_trace) without releasing the GIL, so a trace written
// on a background thread stops the training thread for the whole write; and the result's destructor (tens of
// ms for a 20-step CPU window with stacks, more for a large GPU window) runs under the GIL too, wherever Python
// drops it. save() below calls the same C++ method with the GIL released, on a thread that first lowers its own
// priority, and destroys the result's contents on that thread too: the file is the one export_chrome_trace
// writes, byte for byte, and the training thread keeps the GIL and its core.
#include <torch/csrc/autograd/profiler_kineto.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;
using torch::autograd::profiler::ProfilerResult;

namespace {

// The contents are moved out of the Python-owned result by copying its bytes and constructing an empty result in
// its place (ProfilerResult has no move operations). That is sound only for members that do not point into
// themselves: a uint64_t, std::vectors and a std::unique_ptr, as in every torch 2.x. The size check turns it
// off (the result is then saved in place and freed by Python, as before) when a torch version adds members.
constexpr bool kCanTake =
    sizeof(ProfilerResult) ==
    sizeof(uint64_t) + sizeof(std::vector<torch::autograd::profiler::KinetoEvent>) +
        sizeof(std::unique_ptr<torch::profiler::impl::kineto::ActivityTraceWrapper>) +
        sizeof(std::vector<torch::autograd::profiler::experimental_event_t>);

constexpr std::align_val_t kAlign{alignof(ProfilerResult)};

ProfilerResult* take(ProfilerResult* r) {
  void* mem = ::operator new(sizeof(ProfilerResult), kAlign);
  std::memcpy(mem, static_cast<void*>(r), sizeof(ProfilerResult));
  new (r) ProfilerResult();  // the old contents now belong to mem; the Python object holds an empty result
  return static_cast<ProfilerResult*>(mem);
}

void destroy(ProfilerResult* r) {
  r->~ProfilerResult();
  ::operator delete(static_cast<void*>(r), kAlign);
}

// Runs on the saver thread (no GIL): leave the training thread's core and the cores' normal share to others.
// Each step is best effort; a refusal only means the save competes like any thread.
void lower_this_thread(bool idle, int nice, const std::vector<int>& cpus) {
  if (!cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) {
      if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
    }
    sched_setaffinity(0, sizeof(set), &set);  // 0: this thread
  }
  if (idle) {
    struct sched_param param = {0};
    if (sched_setscheduler(0, SCHED_IDLE, &param) == 0) return;
  }
  if (nice > 0) {
    pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
    setpriority(PRIO_PROCESS, tid, getpriority(PRIO_PROCESS, tid) + nice);
  }
}

// A saver still at idle priority after the grace period: every core is kept busy by work of normal priority (CPU
// training, data loader workers), which SCHED_IDLE yields to almost entirely, so the trace would wait for the
// load to end. It moves to the normal policy `nice` levels down: a small but real share of a busy core.
void raise_thread(pid_t tid, int nice) {
  struct sched_param param = {0};
  sched_setscheduler(tid, SCHED_OTHER, &param);
  setpriority(PRIO_PROCESS, tid, nice);
}

// Writes `result` (a torch._C._autograd._ProfilerResult) to `path` and, where kCanTake, frees its contents, all
// with the GIL released; the caller's thread waits. Errors from kineto come back as the exception save() would
// have raised. Returns whether the contents were freed here (the Python object then holds an empty result,
// which must not be saved again). An idle saver not done after `raise_after_s` (> 0) is raised (raise_thread).
bool save(py::object result, const std::string& path, bool idle, int nice, std::vector<int> cpus,
          double raise_after_s, int raised_nice) {
  ProfilerResult* r = result.cast<ProfilerResult*>();  // the caller holds `result`, so it outlives the save
  ProfilerResult* taken = kCanTake ? take(r) : nullptr;
  std::exception_ptr error;
  {
    py::gil_scoped_release nogil;
    std::mutex lock;
    std::condition_variable finished_cv;
    bool finished = false;
    std::atomic<pid_t> saver_tid{0};
    std::thread saver([&] {
      saver_tid = static_cast<pid_t>(syscall(SYS_gettid));
      try {
        lower_this_thread(idle, nice, cpus);
        (taken ? taken : r)->save(path);
      } catch (...) {
        error = std::current_exception();
      }
      if (taken) destroy(taken);
      std::lock_guard<std::mutex> guard(lock);
      finished = true;
      finished_cv.notify_all();
    });
    if (idle && raise_after_s > 0) {
      std::unique_lock<std::mutex> waiting(lock);
      auto grace = std::chrono::duration<double>(raise_after_s);
      if (!finished_cv.wait_for(waiting, grace, [&] { return finished; }) && saver_tid.load() != 0) {
        raise_thread(saver_tid.load(), raised_nice);
      }
    }
    saver.join();
  }
  if (error) std::rethrow_exception(error);
  return taken != nullptr;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("save", &save, py::arg("result"), py::arg("path"), py::arg("idle"), py::arg("nice"), py::arg("cpus"),
        py::arg("raise_after_s"), py::arg("raised_nice"));
  m.attr("frees_result") = kCanTake;
  m.attr("torch_version") = ODP_TORCH_VERSION;
  m.attr("source_key") = ODP_SOURCE_KEY;
}
