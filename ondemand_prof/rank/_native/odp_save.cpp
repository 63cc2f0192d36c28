// ondemand_prof's GIL-free trace save (rank/native_save.py builds and loads it; README "Output").
//
// torch's ProfilerResult.save() (behind export_chrome_trace) is bound without releasing the GIL, so a trace
// written on a background thread stops the training thread for the whole write. This calls the same C++
// method with the GIL released, on a helper thread that lowers its own priority first: the file is the one
// export_chrome_trace writes, byte for byte, and the training thread keeps the GIL and its core.
#include <torch/csrc/autograd/profiler_kineto.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <exception>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;
using torch::autograd::profiler::ProfilerResult;

namespace {

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

// Writes `result` (a torch._C._autograd._ProfilerResult) to `path`. The caller's thread waits with the GIL
// released; errors from kineto come back as the exception save() would have raised.
void save(py::object result, const std::string& path, bool idle, int nice, std::vector<int> cpus) {
  ProfilerResult* r = result.cast<ProfilerResult*>();  // the caller holds `result`, so it outlives the save
  std::exception_ptr error;
  {
    py::gil_scoped_release nogil;
    std::thread saver([&] {
      try {
        lower_this_thread(idle, nice, cpus);
        r->save(path);
      } catch (...) {
        error = std::current_exception();
      }
    });
    saver.join();
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("save", &save, py::arg("result"), py::arg("path"), py::arg("idle"), py::arg("nice"), py::arg("cpus"));
  m.attr("torch_version") = ODP_TORCH_VERSION;
  m.attr("source_key") = ODP_SOURCE_KEY;
}
