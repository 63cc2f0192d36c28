// ondemand_prof's GIL-free trace save (rank/native_save.py builds and loads it; README "Output").
//
// torch binds ProfilerResult.save() (behind export_chrome_trace) without releasing the GIL, so a trace written
// on a background thread stops the training thread for the whole write; and the result's destructor (tens of
// ms for a 20-step CPU window with stacks, more for a large GPU window) runs under the GIL too, wherever Python
// drops it. save() below hands both to threads of its own and returns at once; the caller waits on the job's
// descriptor (select releases the GIL) and collects the outcome with finish(). The file is the one
// export_chrome_trace writes, byte for byte.
//
//   * The saver thread lowers its own priority (SCHED_IDLE, or nice levels) and writes the trace in place.
//   * The job thread, at the caller's priority (it inherits it) and on the saver's CPUs, then says the trace
//     saved (the descriptor turns readable: the caller publishes it) and only then destroys the result's
//     contents and constructs an empty result in the same place (both through torch's public destructor and
//     constructor; the Python object keeps pointing at a live, empty ProfilerResult). The frees take the malloc
//     arena lock of the thread that allocated the trace (the training thread): a thread at idle priority
//     preempted while holding it would stall the training thread's next allocation until the idle thread ran
//     again (hundreds of ms on busy cores), so they never run at idle priority. They are paced (free_contents):
//     freed in one burst beside the training thread, they cost its steps about their own CPU time again.
//   * No thread of ours takes the GIL or touches a Python object: the Job object holds the Python result alive
//     until the caller has collected it, and the module never reacquires the GIL from a thread that could find
//     the interpreter finalizing.
//   * A process that exits (exit(), C++ static destruction) while a job runs waits for it first (on_exit), for at
//     most the exit wait; past it, the process ends with its own exit status (_exit) instead of destroying what
//     the job still uses.
#include <torch/csrc/autograd/profiler_kineto.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_set>
#include <vector>

namespace py = pybind11;
using torch::autograd::profiler::ProfilerResult;

namespace {

// Nothing was done with the result: the caller may save it another way (odp_save.Unsaved in Python).
struct Unsaved : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ---------------------------------------------------------------------------------------------------------
// The jobs in flight, for the process's exit. Allocated once and never destroyed: a job thread may still use it
// while exit() runs static destructors.

struct Flights {
  std::mutex lock;
  std::condition_variable changed;
  int running = 0;
  std::unordered_set<const ProfilerResult*> results;  // being saved: a second save of one is refused
  std::vector<pid_t> savers;                          // saver threads' ids, raised at exit where allowed
  double exit_wait_s = 30.0;
  bool registered_after_save = false;
  std::atomic<bool> hurry{false};  // the process exits: frees no longer paced
  double last_free_cpu_s = 0, last_free_wall_s = 0;  // the last job's frees: its thread's CPU time, the wall clock
  int last_free_rests = 0;                             // and the rests their pacing took
};

Flights* flights = new Flights();

// In a forked child no job thread exists, and the lock may have been held by one at the fork.
void reset_in_child() {
  double wait = flights->exit_wait_s;
  flights = new Flights();
  flights->exit_wait_s = wait;
  flights->registered_after_save = true;  // the parent's handlers are the child's too
}

void raise_thread(pid_t tid, int nice);

void wait_at_exit(int status, void*) {
  Flights* f = flights;
  std::unique_lock<std::mutex> held(f->lock);
  if (f->running == 0) return;
  f->hurry = true;
  std::fprintf(stderr,
               "ondemand_prof: the process is exiting while %d trace save(s) still run; waiting for them (at most "
               "%.0f s)\n",
               f->running, f->exit_wait_s);
  std::fflush(stderr);
  for (pid_t tid : f->savers) raise_thread(tid, 0);  // training is over (refused unless privileged)
  auto limit = std::chrono::duration<double>(f->exit_wait_s);
  if (f->changed.wait_for(held, limit, [f] { return f->running == 0; })) return;
  std::fprintf(stderr,
               "ondemand_prof: a trace save still runs after %.0f s; the process ends now (exit status %d) without "
               "destroying what it uses\n",
               f->exit_wait_s, status);
  std::fflush(stderr);
  _exit(status);
}

// on_exit handlers and static destructors run in the reverse order of their registration: registered again
// after the first save, the wait also comes before the destructors of statics that save constructed.
void register_exit_wait() {
#ifdef __GLIBC__
  on_exit(wait_at_exit, nullptr);
#else
  std::atexit([] { wait_at_exit(1, nullptr); });
#endif
}

// ---------------------------------------------------------------------------------------------------------
// Priority. Each step is best effort; a refusal only means the thread competes like any thread.

void pin_this_thread(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : cpus) {
    if (cpu >= 0 && cpu < CPU_SETSIZE) CPU_SET(cpu, &set);
  }
  sched_setaffinity(0, sizeof(set), &set);  // 0: this thread
}

// The saver: leave the cores' normal share to others.
void lower_this_thread(bool idle, int nice) {
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
// load to end. It moves to the normal policy `nice` levels down. Linux lets a thread leave SCHED_IDLE only with
// CAP_SYS_NICE or an RLIMIT_NICE that allows the nice level: otherwise this is refused and the save waits.
void raise_thread(pid_t tid, int nice) {
  struct sched_param param = {0};
  if (sched_setscheduler(tid, SCHED_OTHER, &param) == 0) setpriority(PRIO_PROCESS, tid, nice);
}

// ---------------------------------------------------------------------------------------------------------
// A job: save, then free, off the GIL.

struct JobState {
  int fd = -1;  // an eventfd, readable once the trace is saved (or the save failed)
  std::atomic<bool> saved{false};  // the save is over: `error` is set before
  std::atomic<bool> done{false};   // and the result's contents are freed: the job no longer uses the result
  std::exception_ptr error;  // what kineto's save raised
  ~JobState() {
    if (fd >= 0) close(fd);
  }
};

struct Settings {
  std::string path;
  bool idle;
  int nice;
  std::vector<int> cpus;
  double raise_after_s;
  int raised_nice;
};

// The contents are freed paced: a slice of about PACE_SLICE, then a rest PACE_REST times as long. Freed in one burst
// on a core beside the training thread, they cost its steps about their own CPU time again (the frees walk tens
// of MB through the caches and the malloc arena it uses): 8 x Linear(512), one intra-op thread, the 10 steps after
// a 20-step window took 13 ms more of its CPU than idle ones, 3 ms paced (bench_window_cost.py, ours-atonce
// against ours). The events and the event tree, most of it, are moved out through the public accessors (const
// in the interface only: the vectors are the result's own, not const objects) and freed in slices; the rest
// (kineto's trace) through torch's destructor, and an empty result is constructed in its place: an object
// replaced by one of its own type, which the Python object's pointer then designates (C++20 [basic.life]).
// ProfilerResult's default constructor allocates nothing. A process exiting stops the pacing (hurry).
constexpr auto PACE_SLICE = std::chrono::microseconds(500);
constexpr int PACE_REST = 3;
constexpr size_t PACE_BATCH = 64;  // frees between two looks at the clock

// Returns how many rests it took.
int free_paced(ProfilerResult* r) {
  using clock = std::chrono::steady_clock;
  using torch::autograd::profiler::KinetoEvent;
  using torch::autograd::profiler::experimental_event_t;
  auto events = std::move(const_cast<std::vector<KinetoEvent>&>(r->events()));
  auto tree = std::move(const_cast<std::vector<experimental_event_t>&>(r->event_tree()));
  auto slice = clock::now();
  int rests = 0;
  auto pace = [&slice, &rests] {
    auto worked = clock::now() - slice;
    if (worked >= PACE_SLICE && !flights->hurry.load()) {
      std::this_thread::sleep_for(worked * PACE_REST);
      slice = clock::now();
      rests += 1;
    }
  };
  while (!events.empty()) {  // an event holds its result: these first, from the back (no moves)
    for (size_t i = 0; i < PACE_BATCH && !events.empty(); ++i) events.pop_back();
    pace();
  }
  for (size_t i = 0; i < tree.size(); ++i) {  // parents first: each result freed once its parent's is
    tree[i].reset();
    if (i % PACE_BATCH == PACE_BATCH - 1) pace();
  }
  return rests;
}

// Returns the rests the pacing took (0: freed at once).
int free_contents(ProfilerResult* r) noexcept {
  int rests = 0;
#if defined(ODP_BENCH_FREE_BY_ACCESSORS)  // bench/native_variants.py: the events and the tree moved out, the trace
  {                                          // left to Python (freed under the GIL when the result is dropped)
    auto events = std::move(const_cast<std::vector<torch::autograd::profiler::KinetoEvent>&>(r->events()));
    auto tree = std::move(const_cast<std::vector<torch::autograd::profiler::experimental_event_t>&>(r->event_tree()));
  }
  return 0;
#elif defined(ODP_BENCH_KEEP_CONTENTS)  // bench/native_variants.py: nothing freed here (all of it under the GIL)
  return 0;
#elif !defined(ODP_BENCH_FREE_AT_ONCE)  // bench/native_variants.py: everything in one burst (before 2026-12-07)
  try {
    rests = free_paced(r);
  } catch (...) {  // sleep_for or the clock failing: the rest is freed below, at once
  }
#endif
  r->~ProfilerResult();
  ::new (static_cast<void*>(r)) ProfilerResult();
  return rests;
}

bool is_empty(const ProfilerResult* r) {
  return r->trace_start_ns() == 0 && r->events().empty() && r->event_tree().empty();
}

void save_with_lowered_thread(ProfilerResult* r, const Settings& s) {
  std::mutex lock;
  std::condition_variable finished_cv;
  bool finished = false;
  std::atomic<pid_t> saver_tid{0};
  std::exception_ptr error;
  std::thread saver([&] {
    pthread_setname_np(pthread_self(), "odp_save");  // as `top -H` and /proc name it
    pid_t tid = static_cast<pid_t>(syscall(SYS_gettid));
    saver_tid = tid;
    {
      std::lock_guard<std::mutex> guard(flights->lock);
      flights->savers.push_back(tid);
    }
    try {
      lower_this_thread(s.idle, s.nice);
      r->save(s.path);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> guard(flights->lock);
      auto& v = flights->savers;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (*it == tid) {
          v.erase(it);
          break;
        }
      }
    }
    std::lock_guard<std::mutex> guard(lock);
    finished = true;
    finished_cv.notify_all();
  });
  if (s.idle && s.raise_after_s > 0) {
    std::unique_lock<std::mutex> waiting(lock);
    auto grace = std::chrono::duration<double>(s.raise_after_s);
    if (!finished_cv.wait_for(waiting, grace, [&] { return finished; }) && saver_tid.load() != 0) {
      raise_thread(saver_tid.load(), s.raised_nice);
    }
  }
  saver.join();
  if (error) std::rethrow_exception(error);
}

void run_job(ProfilerResult* r, Settings s, std::shared_ptr<JobState> state) {
  pthread_setname_np(pthread_self(), "odp_save_job");
  pin_this_thread(s.cpus);  // the saver inherits it; the frees below run here too, off the training core
  std::exception_ptr error;
  try {
    save_with_lowered_thread(r, s);
  } catch (...) {
    error = std::current_exception();
  }
  state->error = error;
  state->saved = true;  // the caller may publish the trace now; the result stays the job's until `done`
  uint64_t one = 1;
  ssize_t unused = write(state->fd, &one, sizeof(one));
  (void)unused;
  struct timespec cpu0 {}, cpu1 {};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu0);
  auto wall0 = std::chrono::steady_clock::now();
  int rests = free_contents(r);  // saved or not: the result is never saved again (it would only fail, or crash when empty)
  std::chrono::duration<double> wall = std::chrono::steady_clock::now() - wall0;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu1);
  bool first;
  {
    std::lock_guard<std::mutex> guard(flights->lock);
    flights->last_free_cpu_s = (cpu1.tv_sec - cpu0.tv_sec) + (cpu1.tv_nsec - cpu0.tv_nsec) / 1e9;
    flights->last_free_wall_s = wall.count();
    flights->last_free_rests = rests;
    flights->results.erase(r);
    first = !flights->registered_after_save;
    flights->registered_after_save = true;
  }
  if (first) register_exit_wait();
  state->done = true;
  std::lock_guard<std::mutex> guard(flights->lock);
  flights->running -= 1;
  flights->changed.notify_all();
}

class Job {
 public:
  Job(py::object result, std::shared_ptr<JobState> state) : result_(std::move(result)), state_(std::move(state)) {}
  Job(Job&&) = default;
  ~Job() {
    // dropped before the job ended (never by trace_save.py): the job still uses the result, which must outlive it
    if (state_ && !state_->done.load() && result_) result_.release();
  }
  int fileno() const { return state_->fd; }  // readable once saved
  bool saved() const { return state_->saved.load(); }
  bool done() const { return state_->done.load(); }
  // Once saved: raises what the save raised. The result's contents are freed (or being freed) either way: the
  // result may be touched again only once done() (release()).
  void finish() {
    if (!state_->saved.load()) throw std::runtime_error("the trace save is still running");
    release();
    if (state_->error) std::rethrow_exception(state_->error);
  }
  // Lets go of the result once the job no longer uses it; whether it did.
  bool release() {
    if (!state_->done.load()) return false;
    result_ = py::none();
    return true;
  }

 private:
  py::object result_;
  std::shared_ptr<JobState> state_;
};

// Starts saving `result` (a torch._C._autograd._ProfilerResult) to `path`; returns a Job. Raises Unsaved when
// nothing was done (not a ProfilerResult of this torch, no thread or descriptor to be had): the caller may save it
// another way. Any other exception means the result may no longer be saved (it holds no trace, or is being saved).
Job save(py::object result, const std::string& path, bool idle, int nice, std::vector<int> cpus,
         double raise_after_s, int raised_nice) {
  ProfilerResult* r = nullptr;
  try {
    r = result.cast<ProfilerResult*>();
  } catch (const py::cast_error& e) {  // another pybind11 registry, another type
    throw Unsaved(std::string("not a ProfilerResult this module knows: ") + e.what());
  }
  if (r == nullptr) throw Unsaved("no profiler result (None)");
  auto state = std::make_shared<JobState>();
  state->fd = eventfd(0, EFD_CLOEXEC);
  if (state->fd < 0) throw Unsaved(std::string("eventfd: ") + std::strerror(errno));
  {
    // a result not in `results` is used by no job, so it may be looked at here
    std::lock_guard<std::mutex> guard(flights->lock);
    if (flights->results.count(r)) throw std::runtime_error("this profiler result is being saved already");
    if (is_empty(r)) throw std::runtime_error("this profiler result holds no trace: it was written and freed before");
    flights->results.insert(r);
    flights->running += 1;
  }
  Settings s{path, idle, nice, std::move(cpus), raise_after_s, raised_nice};
  try {
    std::thread(run_job, r, std::move(s), state).detach();
  } catch (const std::system_error& e) {
    std::lock_guard<std::mutex> guard(flights->lock);
    flights->results.erase(r);
    flights->running -= 1;
    throw Unsaved(std::string("no thread for the save: ") + e.what());
  }
  return Job(std::move(result), std::move(state));
}

void set_exit_wait(double seconds) {
  std::lock_guard<std::mutex> guard(flights->lock);
  flights->exit_wait_s = seconds;
}

// The last job's frees: its thread's CPU seconds, wall seconds, and the rests their pacing took.
std::tuple<double, double, int> last_free() {
  std::lock_guard<std::mutex> guard(flights->lock);
  return {flights->last_free_cpu_s, flights->last_free_wall_s, flights->last_free_rests};
}

int running() {
  std::lock_guard<std::mutex> guard(flights->lock);
  return flights->running;
}

PyObject* unsaved_type = nullptr;

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // a reference kept for the life of the process (a static py::object would be released after finalization)
  unsaved_type = py::exception<Unsaved>(m, "Unsaved").release().ptr();
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Unsaved& e) {
      PyErr_SetString(unsaved_type, e.what());
    }
  });
  py::class_<Job>(m, "Job", py::module_local())
      .def("fileno", &Job::fileno)
      .def("saved", &Job::saved)
      .def("done", &Job::done)
      .def("finish", &Job::finish)
      .def("release", &Job::release);
  m.def("save", &save, py::arg("result"), py::arg("path"), py::arg("idle"), py::arg("nice"), py::arg("cpus"),
        py::arg("raise_after_s"), py::arg("raised_nice"));
  m.def("set_exit_wait", &set_exit_wait, py::arg("seconds"));
  m.def("running", &running);
  m.def("last_free", &last_free);
  m.attr("frees_result") = true;
  m.attr("torch_version") = ODP_TORCH_VERSION;
  m.attr("source_key") = ODP_SOURCE_KEY;
  register_exit_wait();
  pthread_atfork(nullptr, nullptr, reset_in_child);
}
