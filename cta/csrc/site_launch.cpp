// The eager CUDA path of a PDE site without Python per launch: a C++ call, and an autograd node written by hand, that
// launch the Triton-compiled binaries of ``kernels_launch`` through the driver (``cuLaunchKernel``).
//
// Python (``kernels_cpp``) makes a plan per input metadata the first time it is seen: for the forward and the
// backward, the binary, grid, threads, shared memory and each kernel parameter (an operand's address or an integer
// the plan fixes). A call then costs a key match and the launches. The driver's entry points are looked up in
// libcuda at run time, so the build needs no CUDA headers, only a C++ compiler and torch's.
#include <torch/extension.h>

#include <ATen/Context.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <array>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
constexpr int kMaxParams = 48;

struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**) = nullptr;
  CUresult (*ctx_get)(CUcontext*) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*primary_ctx)(CUcontext*, int) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*param_info)(CUfunction, size_t, size_t*, size_t*) = nullptr;
  CUresult (*is_capturing)(CUstream, int*) = nullptr;
};

template <typename F>
void find(void* lib, const char* name, F& target) {
  target = reinterpret_cast<F>(dlsym(lib, name));
  TORCH_CHECK(target != nullptr, "cta: libcuda has no ", name);
}

const Driver& driver() {
  static const Driver loaded = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    TORCH_CHECK(lib != nullptr, "cta: libcuda.so.1 cannot be opened");
    Driver d;
    find(lib, "cuLaunchKernel", d.launch);
    find(lib, "cuCtxGetCurrent", d.ctx_get);
    find(lib, "cuCtxPushCurrent_v2", d.ctx_push);
    find(lib, "cuCtxPopCurrent_v2", d.ctx_pop);
    find(lib, "cuDevicePrimaryCtxRetain", d.primary_ctx);
    find(lib, "cuDeviceGet", d.device_get);
    find(lib, "cuFuncGetParamInfo", d.param_info);
    find(lib, "cuStreamIsCapturing", d.is_capturing);
    return d;
  }();
  return loaded;
}

// One kernel parameter: an operand's address (operand >= 0), a null pointer (-2) or an immediate (-1) of `size`
// bytes, stored little-endian in `bits`.
struct Slot {
  int64_t operand;
  int64_t size;
  uint64_t bits;
};

struct Launch {
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 128;
  unsigned shared = 0;
  std::vector<Slot> slots;

  void run(void* const* operands, CUstream stream) const {
    uint64_t values[kMaxParams];
    void* params[kMaxParams];
    for (size_t i = 0; i < slots.size(); ++i) {
      const Slot& s = slots[i];
      values[i] = s.operand >= 0 ? reinterpret_cast<uint64_t>(operands[s.operand]) : (s.operand == -2 ? 0 : s.bits);
      params[i] = &values[i];
    }
    CUresult r = driver().launch(function, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, params, nullptr);
    TORCH_CHECK(r == 0, "cta: cuLaunchKernel failed with CUresult ", r);
  }
};

Launch make_launch(int64_t function, std::vector<int64_t> grid, int64_t threads, int64_t shared,
                   const std::vector<std::vector<int64_t>>& slots) {
  Launch l;
  l.function = reinterpret_cast<CUfunction>(function);
  for (int i = 0; i < 3; ++i) l.grid[i] = static_cast<unsigned>(grid.at(i));
  l.threads = static_cast<unsigned>(threads);
  l.shared = static_cast<unsigned>(shared);
  TORCH_CHECK(slots.size() <= kMaxParams, "cta: too many kernel parameters");
  for (const auto& s : slots) l.slots.push_back({s.at(0), s.at(1), static_cast<uint64_t>(s.at(2))});
  // The binary's own parameter list (the driver's) must be the plan's: same count, same sizes.
  size_t offset = 0, size = 0, i = 0;
  for (; driver().param_info(l.function, i, &offset, &size) == 0; ++i) {
    TORCH_CHECK(i < l.slots.size() && size == static_cast<size_t>(l.slots[i].size),
                "cta: the plan's parameter ", i, " does not match the binary's (", size, " bytes)");
  }
  TORCH_CHECK(i == l.slots.size(), "cta: the binary takes ", i, " parameters, the plan ", l.slots.size());
  return l;
}

// What a plan is fixed by: each operand's device, dtype, shape, strides and 16-byte alignment (what the binaries are
// specialised on), and whether deterministic algorithms are asked for. A fixed array: matched with no allocation.
constexpr size_t kKeySize = 48;
using Key = std::array<int64_t, kKeySize>;

size_t put_tensor(Key& key, size_t n, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || n + 4 + 2 * static_cast<size_t>(t.dim()) > kKeySize) {
    key[n] = t.defined() ? -2 : -1;  // (-2: no storage of its own, or more dimensions than a key holds: no plan)
    return n + 1;
  }
  key[n] = t.get_device();
  key[n + 1] = static_cast<int64_t>(t.scalar_type());
  key[n + 2] = t.dim();
  key[n + 3] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
  n += 4;
  for (int64_t d = 0; d < t.dim(); ++d) {
    key[n++] = t.size(d);
    key[n++] = t.stride(d);
  }
  return n;
}

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = 0;
    for (int64_t v : key) h = h * 1000003u ^ static_cast<size_t>(v);
    return h;
  }
};

Key call_key(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& mask) {
  Key key{};
  key[0] = at::globalContext().deterministicAlgorithms() ? 1 : 0;
  size_t n = 1;
  for (const at::Tensor* t : {&x, &alpha, &beta, &mask}) n = put_tensor(key, n, *t);
  return key;
}

// The backward's coefficient gradient of beta: none (no beta), written by the kernel, or zeros (a scheme without it).
enum BetaGrad : int64_t { kNone = 0, kKernel = 1, kZeros = 2 };

// Held by its table and by the backward nodes of the calls it served (a plan the table evicts lives on until their
// backward has run).
struct Plan : std::enable_shared_from_this<Plan> {
  Key key{};
  bool usable = false;  // false: the Python path serves this metadata
  mutable uint64_t last_used = 0;  // the table's clock at its last lookup (least recently used: evicted first)
  int64_t device = 0;
  CUcontext context = nullptr;
  Launch forward, backward;
  int64_t grad_strides[2] = {0, 0};  // the backward's gradient strides (batch, sequence)
  int64_t beta_grad = kNone;
  at::Tensor partials, counters;  // the backward's workspace, left at zero by each launch
  CUstream workspace_stream = nullptr;
  int64_t workspace_floats = 0, workspace_counters = 0;
};

// Makes the plan's device context current on this thread (autograd's device threads may have none) while alive.
struct ContextScope {
  bool pushed = false;
  explicit ContextScope(CUcontext context) {
    CUcontext current = nullptr;
    driver().ctx_get(&current);
    if (current != context) pushed = driver().ctx_push(context) == 0;
  }
  ~ContextScope() {
    if (pushed) {
      CUcontext popped = nullptr;
      driver().ctx_pop(&popped);
    }
  }
};

CUstream current_stream(int64_t device) {
  auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))).native_handle();
}

// Whatever the installed torch holds autograd nodes in (std::shared_ptr, later c10::intrusive_ptr).
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T, typename... Args>
NodePtr make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    return NodePtr(new T(std::forward<Args>(args)...));
  } else {
    return NodePtr(c10::make_intrusive<T>(std::forward<Args>(args)...));
  }
}

// The backward launch of `plan` for the output gradient `g`: {dx, dalpha, dbeta} (dbeta undefined without beta).
torch::autograd::variable_list backward_launch(const Plan& plan, at::Tensor g, const at::Tensor& x,
                                               const at::Tensor& alpha, const at::Tensor& beta,
                                               const at::Tensor& mask) {
  const bool aligned = reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 == 0;
  if (g.scalar_type() != x.scalar_type() || g.stride(0) != plan.grad_strides[0] ||
      g.stride(1) != plan.grad_strides[1] || g.stride(2) != 1 || !aligned) {
    g = at::empty(x.sizes(), x.options()).copy_(g);  // (the dtype, strides and alignment the binary was made for)
  }
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor da = at::empty(alpha.sizes(), alpha.options());
  at::Tensor db;
  if (plan.beta_grad == kKernel) db = at::empty(beta.sizes(), beta.options());
  ContextScope scope(plan.context);
  CUstream stream = current_stream(plan.device);
  at::Tensor partials = plan.partials, counters = plan.counters;
  int capturing = 0;
  driver().is_capturing(stream, &capturing);
  if (stream != plan.workspace_stream || capturing) {
    // another stream, or a CUDA graph's capture: a workspace of this launch's own (as the Python path does)
    partials = at::zeros({plan.workspace_floats}, x.options().dtype(at::kFloat));
    counters = at::zeros({plan.workspace_counters}, x.options().dtype(at::kInt));
  }
  // (an absent beta or mask: x's address in its place, an operand the kernel does not read)
  const at::Tensor& b = beta.defined() ? beta : x;
  const at::Tensor& m = mask.defined() ? mask : x;
  void* operands[] = {g.data_ptr(), x.data_ptr(), dx.data_ptr(), m.data_ptr(), alpha.data_ptr(), b.data_ptr(),
                      da.data_ptr(), (db.defined() ? db : g).data_ptr(), partials.data_ptr(), counters.data_ptr()};
  plan.backward.run(operands, stream);
  if (plan.beta_grad == kZeros) db = at::zeros_like(beta);  // (a scheme whose beta has no gradient)
  return {dx, da, db};
}

// The site's backward node, written by hand rather than as a torch::autograd::Function: inside a model that wrapper's
// bookkeeping (a context, an IValue map, placeholder operands saved) cost more host time than the launches
// (docs/kernels.md). Saved operands are SavedVariables: in-place changes are caught, saved-tensor hooks apply.
struct SiteBackward : public torch::autograd::Node {
  SiteBackward(std::shared_ptr<const Plan> plan, const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
               const at::Tensor& mask)
      : plan_(std::move(plan)), x_(x, false), alpha_(alpha, false), beta_(beta, false), mask_(mask, false) {}

  std::string name() const override { return "CTASiteRefineBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const Plan& plan = *plan_;
    const at::Tensor x = x_.unpack(), alpha = alpha_.unpack(), beta = beta_.unpack(), mask = mask_.unpack();
    at::Tensor g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};  // (the output took no part in the loss)
    return backward_launch(plan, g, x, alpha, beta, mask);
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    x_.reset_data();
    alpha_.reset_data();
    beta_.reset_data();
    mask_.reset_data();
  }

 private:
  std::shared_ptr<const Plan> plan_;  // (its table may evict it before this backward runs)
  torch::autograd::SavedVariable x_, alpha_, beta_, mask_;
};

// The forward launch of `plan`: the refined tensor.
at::Tensor forward_launch(const Plan& plan, const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                          const at::Tensor& mask) {
  at::Tensor y = at::empty(x.sizes(), x.options());
  const at::Tensor& b = beta.defined() ? beta : x;
  const at::Tensor& m = mask.defined() ? mask : x;
  void* operands[] = {x.data_ptr(), y.data_ptr(), m.data_ptr(), alpha.data_ptr(), b.data_ptr()};
  ContextScope scope(plan.context);
  plan.forward.run(operands, current_stream(plan.device));
  return y;
}

// The forward: one launch, and the backward node where autograd asks for one.
at::Tensor refine_with(const Plan& plan, const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                       const at::Tensor& mask) {
  at::Tensor y = forward_launch(plan, x, alpha, beta, mask);
  if (torch::autograd::compute_requires_grad(x, alpha, beta)) {
    NodePtr node = make_node<SiteBackward>(plan.shared_from_this(), x, alpha, beta, mask);
    node->set_next_edges(torch::autograd::collect_next_edges(x, alpha, beta));
    torch::autograd::set_history(y, node);
    if (torch::autograd::AnomalyMode::is_enabled()) node->metadata()->store_stack();
  }
  return y;
}

// The plans of one site configuration (scheme, steps, causality, bounds), one per input metadata seen, at most
// `capacity` of them: a new one evicts the least recently used (made again, and checked again, if its metadata comes
// back). Training with dynamic padding sees a metadata per length.
class PlanTable {
 public:
  explicit PlanTable(int64_t capacity) : capacity_(static_cast<size_t>(capacity)) {}

  // The refined tensor, None where no plan was made for this metadata yet, False where the Python path serves it; an
  // absent beta or mask is an undefined tensor. (Called through `refine_fast`, the module's `refine`.)
  py::object refine(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& mask) {
    const Plan* plan = find(call_key(x, alpha, beta, mask));
    if (plan == nullptr) return py::none();
    // (inference tensors, and forward-mode tangents the kernels would drop: the Python path, which handles both)
    if (!plan->usable || c10::InferenceMode::is_enabled() || torch::autograd::isFwGradDefined(x) ||
        torch::autograd::isFwGradDefined(alpha) || torch::autograd::isFwGradDefined(beta)) {
      return py::bool_(false);
    }
    return py::cast(refine_with(*plan, x, alpha, beta, mask));
  }

  // The launches alone, no autograd node (the compiled graph's custom ops, whose autograd is the graph's): the
  // refined tensor, or (dx, dalpha, dbeta); None and False as for `refine`.
  py::object forward(const at::Tensor& x, const at::Tensor& alpha, const c10::optional<at::Tensor>& beta,
                     const c10::optional<at::Tensor>& mask) {
    const Call call = lookup(x, alpha, beta, mask);
    if (call.plan == nullptr) return py::none();
    if (!call.plan->usable) return py::bool_(false);
    return py::cast(forward_launch(*call.plan, x, alpha, call.beta, call.mask));
  }

  py::object backward(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& alpha,
                      const c10::optional<at::Tensor>& beta, const c10::optional<at::Tensor>& mask) {
    const Call call = lookup(x, alpha, beta, mask);
    if (call.plan == nullptr) return py::none();
    if (!call.plan->usable) return py::bool_(false);
    TORCH_CHECK(gy.sizes() == x.sizes() && gy.device() == x.device(), "cta: the gradient is not shaped as the input");
    torch::autograd::variable_list grads = backward_launch(*call.plan, gy, x, alpha, call.beta, call.mask);
    return py::make_tuple(grads[0], grads[1], grads[2]);  // (an undefined dbeta: None)
  }

  Key key(const at::Tensor& x, const at::Tensor& alpha, const c10::optional<at::Tensor>& beta,
          const c10::optional<at::Tensor>& mask) const {
    return call_key(x, alpha, beta.has_value() ? *beta : at::Tensor(), mask.has_value() ? *mask : at::Tensor());
  }

  // Python's path serves this metadata from now on (until evicted).
  void refuse(const Key& key) {
    auto found = plans_.find(key);
    if (found != plans_.end()) {
      found->second->usable = false;
      return;
    }
    auto plan = std::make_shared<Plan>();
    plan->key = key;
    insert(std::move(plan));
  }

  // (a plan is never replaced: a pending backward may hold it)
  void add(const Key& key, int64_t device, py::tuple forward, py::tuple backward,
           std::vector<int64_t> grad_strides, int64_t beta_grad, at::Tensor partials, at::Tensor counters,
           int64_t workspace_stream) {
    TORCH_CHECK(plans_.count(key) == 0, "cta: a plan for this metadata exists");
    auto plan = std::make_shared<Plan>();
    plan->key = key;
    plan->device = device;
    int cu_device = 0;
    TORCH_CHECK(driver().device_get(&cu_device, static_cast<int>(device)) == 0, "cta: no CUDA device ", device);
    TORCH_CHECK(driver().primary_ctx(&plan->context, cu_device) == 0, "cta: no primary context on ", device);
    auto launch_of = [](const py::tuple& spec) {  // (function, grid, threads, shared memory, slots)
      return make_launch(spec[0].cast<int64_t>(), spec[1].cast<std::vector<int64_t>>(), spec[2].cast<int64_t>(),
                         spec[3].cast<int64_t>(), spec[4].cast<std::vector<std::vector<int64_t>>>());
    };
    plan->forward = launch_of(forward);
    plan->backward = launch_of(backward);
    plan->grad_strides[0] = grad_strides.at(0);
    plan->grad_strides[1] = grad_strides.at(1);
    plan->beta_grad = beta_grad;
    plan->partials = partials;
    plan->counters = counters;
    plan->workspace_floats = partials.numel();
    plan->workspace_counters = counters.numel();
    plan->workspace_stream = reinterpret_cast<CUstream>(workspace_stream);
    plan->usable = true;
    insert(std::move(plan));
  }

  size_t size() const { return plans_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  // A call's plan (nullptr: none made yet for its metadata), its absent beta and mask as undefined tensors.
  struct Call {
    at::Tensor beta, mask;
    const Plan* plan;
  };

  Call lookup(const at::Tensor& x, const at::Tensor& alpha, const c10::optional<at::Tensor>& beta,
              const c10::optional<at::Tensor>& mask) const {
    Call call{beta.has_value() ? *beta : at::Tensor(), mask.has_value() ? *mask : at::Tensor(), nullptr};
    call.plan = find(call_key(x, alpha, call.beta, call.mask));
    return call;
  }

  const Plan* find(const Key& key) const {
    if (last_ == nullptr || last_->key != key) {  // (a model's sites mostly share one metadata)
      auto found = plans_.find(key);
      if (found == plans_.end()) return nullptr;
      last_ = found->second.get();
    }
    last_->last_used = ++clock_;
    return last_;
  }

  // A new plan, the least recently used one evicted first where the table is full (a scan: plans are made rarely,
  // each with a checked call on both paths, far dearer than this).
  void insert(std::shared_ptr<Plan> plan) {
    if (plans_.size() >= capacity_) {
      auto oldest = plans_.begin();
      for (auto it = plans_.begin(); it != plans_.end(); ++it) {
        if (it->second->last_used < oldest->second->last_used) oldest = it;
      }
      if (last_ == oldest->second.get()) last_ = nullptr;
      plans_.erase(oldest);
    }
    plan->last_used = ++clock_;
    plans_.emplace(plan->key, std::move(plan));
  }

  size_t capacity_;
  std::unordered_map<Key, std::shared_ptr<Plan>, KeyHash> plans_;  // (one per metadata seen: shapes may vary)
  mutable const Plan* last_ = nullptr;  // the plan found last (cleared when evicted; called with the GIL held)
  mutable uint64_t clock_ = 0;  // lookups and insertions so far (each plan's last_used)
};

// The site's call as a METH_FASTCALL function, `refine(table, x, alpha, beta, mask)` (beta and mask: tensors or
// None): as a pybind11 method its argument dispatch cost about 4 of a site's 21-26 us forward (H200 hosts,
// docs/kernels.md).
PyObject* refine_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  // (errors set as Python's: nothing is thrown through the interpreter)
  if (nargs != 5) {
    PyErr_Format(PyExc_TypeError, "cta: refine(table, x, alpha, beta, mask) takes 5 arguments, got %zd", nargs);
    return nullptr;
  }
  for (Py_ssize_t i = 1; i < 5; ++i) {
    if (!(i >= 3 && args[i] == Py_None) && !THPVariable_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "cta: refine's argument %zd is not a tensor%s", i, i >= 3 ? " or None" : "");
      return nullptr;
    }
  }
  static const at::Tensor absent;
  auto tensor = [&](Py_ssize_t i) -> const at::Tensor& {
    return args[i] == Py_None ? absent : THPVariable_Unpack(args[i]);
  };
  try {
    PlanTable& table = py::cast<PlanTable&>(py::handle(args[0]));
    return table.refine(tensor(1), tensor(2), tensor(3), tensor(4)).release().ptr();
  } catch (python_error& error) {  // (a Python error raised inside, e.g. by a saved-tensor hook: restored as is;
    error.restore();               // non-reentrant checkpointing stops its recomputation with one)
  } catch (py::error_already_set& error) {
    error.restore();
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

PyMethodDef fast_functions[] = {
    {"refine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(refine_fast)), METH_FASTCALL,
     "refine(table, x, alpha, beta, mask): a site's call through the table's plans (PlanTable::refine)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<PlanTable>(m, "PlanTable")
      // (checked before construction: a c10::Error thrown from a bound constructor crashed torch 2.11's Python 3.12)
      .def(py::init([](int64_t capacity) {
             if (capacity < 1)
               throw py::value_error("cta: a plan table holds at least one plan, got capacity " +
                                     std::to_string(capacity));
             return std::make_unique<PlanTable>(capacity);
           }),
           py::arg("capacity"))
      .def("forward", &PlanTable::forward)
      .def("backward", &PlanTable::backward)
      .def("key", &PlanTable::key)
      .def("refuse", &PlanTable::refuse)
      .def("add", &PlanTable::add)
      .def("__len__", &PlanTable::size)
      .def_property_readonly("capacity", &PlanTable::capacity)
      .def("__deepcopy__", [](py::object self, py::object) { return self; });
  TORCH_CHECK(PyModule_AddFunctions(m.ptr(), fast_functions) == 0, "cta: the fast entry did not register");
}
