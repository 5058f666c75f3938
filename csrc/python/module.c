/* megatron_p2p._C: module state, exceptions and the few module-level functions. */
#include "bindings.h"
#include "core/dtype.h"
#include "core/plan.h"
#include "session.h"
#include "shm/shm_transport.h"

static struct PyModuleDef module_def;
extern PyMethodDef mp_nccl_methods[];
extern PyMethodDef mp_simulate_methods[];

mp_state *mp_state_from_type(PyTypeObject *tp)
{
    PyObject *mod = PyType_GetModuleByDef(tp, &module_def);
    return mod ? (mp_state *)PyModule_GetState(mod) : NULL;
}

static mp_state *state_of(PyObject *mod) { return (mp_state *)PyModule_GetState(mod); }

static PyObject *new_unique_id(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored))
{
    char name[MP_SHM_NAME_LEN];
    if (mp_shm_new_name(name, sizeof name) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyUnicode_FromString(name);
}

static PyObject *check_tensor(PyObject *mod, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"tensor", "name", "device", NULL};
    PyObject *tensor;
    const char *what = "tensor";
    int device = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|si:check_tensor", kwlist, &tensor, &what, &device))
        return NULL;
    mp_buffer buf;
    if (mp_read_tensor(state_of(mod), tensor, what, device, &buf) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *plan(PyObject *Py_UNUSED(mod), PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"mode", "lanes", "rank", "ops", "prev_is_self", "next_is_self", NULL};
    const char *mode;
    int lanes, rank, prev_self = 0, next_self = 0;
    PyObject *ops;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "siiO|pp:plan", kwlist, &mode, &lanes, &rank, &ops, &prev_self,
                                     &next_self))
        return NULL;
    mp_plan_input in = {.nlanes = lanes, .rank = rank, .prev_is_self = prev_self, .next_is_self = next_self};
    int found_mode = -1;
    for (int m = 0; m < MP_NUM_MODES; m++)
        if (strcmp(mode, mp_mode_name((mp_mode)m)) == 0)
            found_mode = m;
    if (found_mode < 0)
        return PyErr_Format(PyExc_ValueError, "mode must be '%s' or '%s', got '%s'", mp_mode_name(MP_MODE_PARITY),
                            mp_mode_name(MP_MODE_BATCHED), mode);
    in.mode = (mp_mode)found_mode;
    PyObject *it = PyObject_GetIter(ops), *name;
    if (!it)
        return NULL;
    while ((name = PyIter_Next(it))) {
        int found = -1;
        for (int s = 0; s < MP_NUM_SLOTS; s++)
            if (PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, mp_slot_name((mp_slot)s)) == 0)
                found = s;
        if (found < 0) {
            PyErr_Format(PyExc_ValueError, "unknown op %R", name);
            Py_DECREF(name);
            Py_DECREF(it);
            return NULL;
        }
        in.present |= 1u << found;
        Py_DECREF(name);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    mp_plan p;
    mp_plan_exchange(&in, &p);
    PyObject *out = PyList_New(p.nsteps);
    for (int i = 0; out && i < p.nsteps; i++) {
        PyObject *names = PyTuple_New(p.steps[i].nops);
        for (int j = 0; names && j < p.steps[i].nops; j++)
            PyTuple_SET_ITEM(names, j, PyUnicode_FromString(mp_slot_name(p.steps[i].ops[j])));
        PyObject *step = names ? Py_BuildValue("(iN)", p.steps[i].lane, names) : NULL;
        if (!step) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, step);
    }
    return out;
}

/* os.register_at_fork(after_in_child=...): a fork child disowns every Communicator it inherited,
 * before any of its code runs (docs/api.md, "Fork"). */
static PyObject *after_fork_in_child(PyObject *mod, PyObject *Py_UNUSED(ignored))
{
    mp_state *st = state_of(mod);
    PyObject *comms = st->live ? PySequence_List(st->live) : NULL;
    if (!comms)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(comms); i++)
        mp_comm_disown((CommObject *)PyList_GET_ITEM(comms, i));
    Py_DECREF(comms);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_after_fork_in_child", after_fork_in_child, METH_NOARGS,
     "_after_fork_in_child()\n--\n\nRun by os.register_at_fork in a fork child: disowns the Communicators the child inherited."},
    {"new_unique_id", new_unique_id, METH_NOARGS,
     "new_unique_id()\n--\n\nA str: an unguessable shared-memory segment name for a new communicator."},
    {"check_tensor", (PyCFunction)(void (*)(void))check_tensor, METH_VARARGS | METH_KEYWORDS,
     "check_tensor(tensor, name='tensor', device=-1)\n--\n\nRaises the TypeError or ValueError that posting "
     "`tensor` would raise on a communicator of `device` (-1: the CPU), naming it `name`; posts nothing."},
    {"plan", (PyCFunction)(void (*)(void))plan, METH_VARARGS | METH_KEYWORDS,
     "plan(mode, lanes, rank, ops, prev_is_self=False, next_is_self=False)\n--\n\n"
     "A list of (lane, (op, ...)): the steps an exchange of `ops` issues on group rank `rank`, in issue order."},
    {NULL},
};

static int add_exception(PyObject *mod, PyObject **slot, const char *name, PyObject *base, const char *doc)
{
    char qualified[96];
    snprintf(qualified, sizeof qualified, "megatron_p2p.%s", name);
    *slot = PyErr_NewExceptionWithDoc(qualified, doc, base, NULL);
    if (!*slot)
        return -1;
    return PyModule_AddObjectRef(mod, name, *slot);
}

static int load_torch(mp_state *st)
{
    PyObject *torch = PyImport_ImportModule("torch");
    if (!torch)
        return -1;
    st->tensor_type = PyObject_GetAttrString(torch, "Tensor");
    st->strided = PyObject_GetAttrString(torch, "strided");
    st->torch_empty = PyObject_GetAttrString(torch, "empty");
    st->from_dlpack = PyObject_GetAttrString(torch, "from_dlpack");
    st->dtype_codes = PyDict_New();
    int rc = st->tensor_type && st->strided && st->torch_empty && st->from_dlpack && st->dtype_codes ? 0 : -1;
    for (int code = 0; rc == 0 && code < MP_NUM_DTYPES; code++) {
        PyObject *dt = PyObject_GetAttrString(torch, mp_dtype_name(code));
        if (!dt) {
            PyErr_Clear(); /* older torch: that dtype does not exist there */
            continue;
        }
        PyObject *c = PyLong_FromLong(code);
        rc = c ? PyDict_SetItem(st->dtype_codes, dt, c) : -1;
        Py_XDECREF(c);
        Py_DECREF(dt);
    }
    if (rc == 0)
        rc = mp_tensor_attrs_load(st, torch);
    for (int slot = 0; rc == 0 && slot < MP_NUM_SLOTS; slot++)
        rc = (st->slot_names[slot] = PyUnicode_InternFromString(mp_slot_name((mp_slot)slot))) ? 0 : -1;
    static const char *const options[MP_EXCHANGE_OPTIONS] = {"mode", "prev_rank", "next_rank", "call"};
    for (int i = 0; rc == 0 && i < MP_EXCHANGE_OPTIONS; i++)
        rc = (st->exchange_options[i] = PyUnicode_InternFromString(options[i])) ? 0 : -1;
    Py_DECREF(torch);
    return rc;
}

/* The set of live Communicators, and the fork hook that disowns them in a child. */
static int watch_forks(PyObject *mod, mp_state *st)
{
    PyObject *weakref = PyImport_ImportModule("weakref");
    st->live = weakref ? PyObject_CallMethod(weakref, "WeakSet", NULL) : NULL;
    Py_XDECREF(weakref);
    PyObject *os = st->live ? PyImport_ImportModule("os") : NULL;
    PyObject *hook = os ? PyObject_GetAttrString(mod, "_after_fork_in_child") : NULL;
    PyObject *args = hook ? PyTuple_New(0) : NULL;
    PyObject *kwargs = args ? Py_BuildValue("{s:O}", "after_in_child", hook) : NULL;
    PyObject *reg = kwargs ? PyObject_GetAttrString(os, "register_at_fork") : NULL;
    PyObject *done = reg ? PyObject_Call(reg, args, kwargs) : NULL;
    Py_XDECREF(os);
    Py_XDECREF(hook);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(reg);
    Py_XDECREF(done);
    return done ? 0 : -1;
}

static const char *slot_name(int i) { return mp_slot_name((mp_slot)i); }
static const char *mode_name(int i) { return mp_mode_name((mp_mode)i); }

/* mod.<attr>: the tuple of the C core's names 0..n-1 (one name table, read from Python). */
static int add_names(PyObject *mod, const char *attr, int n, const char *(*name_of)(int))
{
    PyObject *names = PyTuple_New(n);
    for (int i = 0; names && i < n; i++) {
        PyObject *name = PyUnicode_FromString(name_of(i));
        if (!name) {
            Py_CLEAR(names);
            break;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    int rc = names ? PyModule_AddObjectRef(mod, attr, names) : -1;
    Py_XDECREF(names);
    return rc;
}

static int module_exec(PyObject *mod)
{
    mp_state *st = state_of(mod);
    PyObject *timeout_bases = NULL;
    if (add_exception(mod, &st->P2PError, "P2PError", PyExc_RuntimeError,
                      "A point-to-point operation or communicator failed.") < 0)
        return -1;
    timeout_bases = PyTuple_Pack(2, st->P2PError, PyExc_TimeoutError);
    if (!timeout_bases)
        return -1;
    int rc = add_exception(mod, &st->P2PTimeoutError, "P2PTimeoutError", timeout_bases,
                           "A wait passed its deadline. The message lists this rank's pending ops; the communicator "
                           "is aborted so that its peers fail too.");
    Py_DECREF(timeout_bases);
    if (rc < 0 ||
        add_exception(mod, &st->DeadlockError, "DeadlockError", st->P2PTimeoutError,
                      "This rank is in a wait-for cycle: ranks all blocked in waits, each needing the next to post "
                      "an op it has not posted. It can never resolve, so it is raised at once rather than at the "
                      "timeout. The message names every rank and op of the cycle.") < 0 ||
        add_exception(mod, &st->MismatchError, "MismatchError", st->P2PError,
                      "A matched send and receive disagree on byte count or dtype.") < 0 ||
        add_exception(mod, &st->PeerFailureError, "PeerFailureError", st->P2PError,
                      "A process of the communicator died.") < 0 ||
        add_exception(mod, &st->BackendUnavailableError, "BackendUnavailableError", st->P2PError,
                      "The requested backend cannot run here (missing library or device).") < 0)
        return -1;
    if (load_torch(st) < 0 || mp_capi_add(mod) < 0 || watch_forks(mod, st) < 0)
        return -1;
    if (PyModule_AddFunctions(mod, mp_nccl_methods) < 0 || PyModule_AddFunctions(mod, mp_simulate_methods) < 0)
        return -1;
    st->CommunicatorType = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &mp_communicator_spec, NULL);
    if (!st->CommunicatorType || PyModule_AddType(mod, st->CommunicatorType) < 0)
        return -1;
    st->RequestType = (PyTypeObject *)PyType_FromModuleAndSpec(mod, &mp_request_spec, NULL);
    if (!st->RequestType || PyModule_AddType(mod, st->RequestType) < 0)
        return -1;
    if (add_names(mod, "DTYPE_NAMES", MP_NUM_DTYPES, mp_dtype_name) < 0 ||
        add_names(mod, "SLOT_NAMES", MP_NUM_SLOTS, slot_name) < 0 ||
        add_names(mod, "MODE_NAMES", MP_NUM_MODES, mode_name) < 0)
        return -1;
    if (PyModule_AddIntConstant(mod, "MAX_LANES", MP_MAX_LANES) < 0 ||
        PyModule_AddIntConstant(mod, "DEFAULT_ARENA_BYTES", (long)MP_ARENA_DEFAULT_BYTES) < 0 ||
        PyModule_AddIntConstant(mod, "MAX_ARENA_BYTES", (long)MP_ARENA_MAX_BYTES) < 0 ||
        PyModule_AddIntConstant(mod, "ARENA_WAIT_BYTES", MP_SHM_OFFER_WAIT_BYTES) < 0)
        return -1;
    return PyModule_AddIntConstant(mod, "MAX_EAGER_THRESHOLD", MP_SHM_MAX_EAGER);
}

static int module_traverse(PyObject *mod, visitproc visit, void *arg)
{
    mp_state *st = state_of(mod);
    Py_VISIT(st->P2PError);
    Py_VISIT(st->P2PTimeoutError);
    Py_VISIT(st->DeadlockError);
    Py_VISIT(st->MismatchError);
    Py_VISIT(st->PeerFailureError);
    Py_VISIT(st->BackendUnavailableError);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->strided);
    Py_VISIT(st->torch_empty);
    Py_VISIT(st->from_dlpack);
    Py_VISIT(st->dtype_codes);
    Py_VISIT(st->parameter_type);
    for (int a = 0; a < MP_NUM_TENSOR_ATTRS; a++)
        Py_VISIT(st->attr_descrs[a]);
    Py_VISIT(st->CommunicatorType);
    Py_VISIT(st->RequestType);
    Py_VISIT(st->live);
    return 0;
}

static int module_clear(PyObject *mod)
{
    mp_state *st = state_of(mod);
    Py_CLEAR(st->P2PError);
    Py_CLEAR(st->P2PTimeoutError);
    Py_CLEAR(st->DeadlockError);
    Py_CLEAR(st->MismatchError);
    Py_CLEAR(st->PeerFailureError);
    Py_CLEAR(st->BackendUnavailableError);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->strided);
    Py_CLEAR(st->torch_empty);
    Py_CLEAR(st->from_dlpack);
    Py_CLEAR(st->dtype_codes);
    Py_CLEAR(st->parameter_type);
    for (int slot = 0; slot < MP_NUM_SLOTS; slot++)
        Py_CLEAR(st->slot_names[slot]);
    for (int i = 0; i < MP_EXCHANGE_OPTIONS; i++)
        Py_CLEAR(st->exchange_options[i]);
    for (int a = 0; a < MP_NUM_TENSOR_ATTRS; a++) {
        Py_CLEAR(st->attr_names[a]);
        Py_CLEAR(st->attr_descrs[a]);
    }
    Py_CLEAR(st->CommunicatorType);
    Py_CLEAR(st->RequestType);
    Py_CLEAR(st->live);
    return 0;
}

static void module_free(void *mod) { module_clear((PyObject *)mod); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "megatron_p2p._C",
    .m_doc = "C core of megatron_p2p: the plan, the transports and their Python bindings.",
    .m_size = sizeof(mp_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
