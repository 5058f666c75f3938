/* Posting: exchange(), isend(), irecv() and batch(). Every argument is checked before anything
 * is posted, so a misuse leaves the communicator usable; then the plan's steps are numbered and
 * posted with the GIL released once per call. */
#include <stdlib.h>
#include <string.h>

#include "communicator.h"
#include "core/clock.h"
#include "request.h"

/* One op awaiting posting: validated, not yet numbered. */
typedef struct {
    PyObject *tensor;
    mp_buffer buf;
    mp_kind kind;
    mp_label label;
    int peer;
    int lane;
} pending_op;

/* NCCL's rule, kept here for every transport: a send to oneself needs its receive in the same
 * group, or it can never complete. */
static int check_self_pairs(CommObject *self, const pending_op *ops, int nops)
{
    int sends = 0, recvs = 0;
    for (int i = 0; i < nops; i++)
        if (ops[i].peer == self->group_rank)
            ops[i].kind == MP_SEND ? sends++ : recvs++;
    if (sends != recvs) {
        PyErr_Format(PyExc_ValueError,
                     "%d send(s) and %d receive(s) address this rank itself in one group: a self send needs its "
                     "matching self receive in the same group (batch_isend_irecv or one exchange)",
                     sends, recvs);
        return -1;
    }
    return 0;
}

/* Device transports order what one call posts after the caller's stream, and fence it after. */
static int begin_posting(CommObject *self)
{
    mp_transport *t = self->transport;
    void *stream = NULL;
    if ((mp_transport_caps(t) & MP_CAP_DEVICE_STREAMS) && mp_comm_stream(self, &stream) < 0)
        return -1;
    mp_result r = MP_ERR_CLOSED;
    if (!(mp_transport_caps(t) & MP_CAP_BEGIN_END_MAY_WAIT)) {
        r = mp_transport_begin(t, stream);
    } else if ((t = mp_comm_enter(self))) { /* a close meanwhile is left to our leave */
        Py_BEGIN_ALLOW_THREADS /* another thread's posting may hold the transport's lock a while */
        r = mp_transport_begin(t, stream);
        Py_END_ALLOW_THREADS
        mp_comm_leave(self);
    }
    if (r == MP_ERR_CAPTURE) {
        PyErr_SetString(self->state->P2PError, "debug matching (MEGATRON_P2P_CHECK=1) waits on the host before "
                        "every step, which CUDA graph capture forbids: unset it to capture this call");
        return -1;
    }
    if (r != MP_OK) {
        if (mp_comm_check_usable(self) == 0)
            PyErr_SetString(self->state->P2PError, "could not order the ops after the current stream");
        return -1;
    }
    return 0;
}

/* A failure here has failed the posted ops already; their Requests report it. */
static void end_posting(CommObject *self)
{
    mp_transport *t = self->transport;
    if (!t)
        return;
    if (!(mp_transport_caps(t) & MP_CAP_BEGIN_END_MAY_WAIT)) {
        mp_transport_end(t);
    } else if ((t = mp_comm_enter(self))) {
        Py_BEGIN_ALLOW_THREADS
        mp_transport_end(t);
        Py_END_ALLOW_THREADS
        mp_comm_leave(self);
    }
}

/* Debug matching compares shapes: the tensor's, read here (torch.Size is a tuple). */
static int read_shape(CommObject *self, PyObject *tensor, mp_op *op)
{
    PyObject *shape = mp_tensor_attr_get(self->state, tensor, MP_ATTR_SHAPE);
    if (!shape)
        return -1;
    Py_ssize_t ndim = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : -1;
    op->ndim = ndim >= 0 && ndim <= MP_MAX_DIMS ? (int)ndim : -1; /* beyond that, bytes and dtype decide */
    for (int d = 0; d < op->ndim; d++)
        op->shape[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d));
    Py_DECREF(shape);
    return PyErr_Occurred() ? -1 : 0;
}

/* One step of a call, before posting: its ops in issue order, on one lane. */
typedef struct {
    pending_op *ops;
    int nops;
    int lane;
} step_plan;

/* Makes the step's Requests (stored in `reqs`, new references); NULL with an error set when one
 * cannot be made. */
static mp_step *make_step(CommObject *self, const step_plan *sp, RequestObject **reqs)
{
    mp_step *step = malloc(sizeof(mp_step) + sizeof(mp_op *) * (size_t)(sp->nops ? sp->nops : 1));
    if (!step) {
        PyErr_NoMemory();
        return NULL;
    }
    for (int i = 0; i < sp->nops; i++) {
        reqs[i] = mp_request_new(self, sp->ops[i].tensor, &sp->ops[i].buf);
        if (!reqs[i] || (self->check && read_shape(self, sp->ops[i].tensor, &reqs[i]->op) < 0)) {
            for (int j = 0; j <= i; j++)
                Py_CLEAR(reqs[j]);
            free(step);
            return NULL;
        }
        step->ops[i] = &reqs[i]->op;
    }
    step->lane = sp->lane;
    step->nops = sp->nops;
    return step;
}

/* Numbers the step's ops in the communicator's sequences, for API call `call_name`. */
static void number_step(CommObject *self, const step_plan *sp, mp_step *step, const char *call_name, double now)
{
    size_t call_len = call_name ? strnlen(call_name, MP_CALL_NAME_LEN - 1) : 0;
    for (int i = 0; i < sp->nops; i++) {
        const pending_op *p = &sp->ops[i];
        mp_op *op = step->ops[i];
        op->kind = p->kind;
        op->label = p->label;
        op->peer = p->peer;
        op->peer_global = self->global_ranks[p->peer];
        op->lane = sp->lane;
        op->seq = mp_number_message(&self->numbers[mp_channel_of(self->size, sp->lane, p->peer)], p->kind);
        op->step = self->lane_steps[sp->lane];
        op->call = self->calls;
        if (call_name) /* the op starts zeroed: no name, nothing to copy */
            memcpy(op->call_name, call_name, call_len);
        if (op->kind == MP_SEND) {
            self->sends++;
            self->bytes_sent += op->nbytes;
        } else {
            self->recvs++;
            self->bytes_received += op->nbytes;
        }
    }
    self->lane_steps[sp->lane]++;
    mp_trace_step(self->trace, step, now);
}

/* Posts the steps of one call in order for API call `call_name` and stores each op's Request in
 * `reqs` (new references, in step order). Every Request is made first, so that a failure to make
 * one numbers and posts nothing, and the GIL is released once for all the steps. */
static int post_steps(CommObject *self, const step_plan *plans, int nsteps, const char *call_name,
                      RequestObject **reqs)
{
    mp_step *local[MP_NUM_SLOTS], **steps = nsteps > MP_NUM_SLOTS ? PyMem_Calloc((size_t)nsteps, sizeof *steps) : local;
    if (!steps) {
        PyErr_NoMemory();
        return -1;
    }
    int made = 0, nreqs = 0;
    while (made < nsteps && (steps[made] = make_step(self, &plans[made], reqs + nreqs)))
        nreqs += plans[made++].nops;
    mp_result r = MP_OK;
    int posted = 0; /* steps the transport took */
    if (made == nsteps) { /* numbered only once all can be posted: the sequences never skip */
        double now = mp_wall_time();
        for (int i = 0; i < nsteps; i++) {
            number_step(self, &plans[i], steps[i], call_name, now);
            steps[i]->more_follow = i + 1 < nsteps;
        }
        mp_transport *t = mp_comm_enter(self); /* open: the callers checked */
        if (!t) {
            r = MP_ERR_CLOSED;
        } else {
            Py_BEGIN_ALLOW_THREADS /* posting may progress (and copy) right away */
            while (posted < nsteps && (r = t->ops->post(t, steps[posted])) == MP_OK)
                posted++;
            Py_END_ALLOW_THREADS
            mp_comm_leave(self);
        }
    }
    for (int i = posted; i < made; i++)
        free(steps[i]);
    if (steps != local)
        PyMem_Free(steps);
    int kept = 0; /* Requests of the posted steps: in flight whatever else failed */
    for (int i = 0; i < posted; i++)
        kept += plans[i].nops;
    int rc = made == nsteps ? 0 : -1; /* else the error of the Request that could not be made is set */
    for (int i = 0; rc == 0 && i < kept; i++)
        rc = PyList_Append(self->inflight, (PyObject *)reqs[i]);
    if (rc == 0 && r != MP_OK) {
        mp_comm_check_usable(self);
        if (!PyErr_Occurred())
            PyErr_Format(self->state->P2PError, "posting failed: %s", mp_result_str(r));
        rc = -1;
    }
    if (rc < 0) {
        for (int i = 0; i < nreqs; i++)
            Py_CLEAR(reqs[i]);
        return -1;
    }
    /* Posting itself may have aborted (a launch that failed, a debug-matching disagreement): the
     * peers must hear of it, or their ops wait for ours until their timeout. */
    int cause_rank;
    mp_transport *t = self->transport; /* NULL: closed by another thread while posting */
    for (int i = 0; t && i < kept; i++) {
        const mp_op *op = &reqs[i]->op;
        if (mp_op_done(op) && op->result != MP_OK) {
            if (t->ops->abort_cause(t, &cause_rank) != MP_OK && cause_rank == self->group_rank) {
                PyObject *why = PyUnicode_FromString(op->detail);
                PyErr_Clear();
                mp_comm_publish_abort(self, why);
                Py_XDECREF(why);
            }
            break;
        }
    }
    return 0;
}

static int parse_mode(PyObject *mode, mp_mode *out)
{
    for (int m = 0; PyUnicode_Check(mode) && m < MP_NUM_MODES; m++)
        if (PyUnicode_CompareWithASCIIString(mode, mp_mode_name((mp_mode)m)) == 0) {
            *out = (mp_mode)m;
            return 0;
        }
    PyErr_Format(PyExc_ValueError, "mode must be '%s' or '%s', got %R", mp_mode_name(MP_MODE_PARITY),
                 mp_mode_name(MP_MODE_BATCHED), mode);
    return -1;
}

/* Where keyword `kw` goes among exchange()'s arguments (the four slots, then the options), or -1.
 * Keywords written in source are interned, so identity almost always decides. */
static int exchange_argument(mp_state *st, PyObject *kw)
{
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < MP_NUM_SLOTS + MP_EXCHANGE_OPTIONS; i++) {
            PyObject *name = i < MP_NUM_SLOTS ? st->slot_names[i] : st->exchange_options[i - MP_NUM_SLOTS];
            if (pass ? PyUnicode_Compare(kw, name) == 0 : kw == name)
                return i;
        }
    return -1;
}

/* METH_FASTCALL: PyArg_ParseTupleAndKeywords' tuple and dict were a tenth of the binding's cost. */
PyObject *mp_comm_exchange(CommObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *given[MP_NUM_SLOTS + MP_EXCHANGE_OPTIONS] = {Py_None, Py_None, Py_None, Py_None,
                                                          NULL,    Py_None, Py_None, Py_None};
    if (nargs > MP_NUM_SLOTS)
        return PyErr_Format(PyExc_TypeError, "exchange() takes at most %d positional arguments (%zd given)",
                            MP_NUM_SLOTS, nargs);
    for (Py_ssize_t i = 0; i < nargs; i++)
        given[i] = args[i];
    for (Py_ssize_t k = 0; kwnames && k < PyTuple_GET_SIZE(kwnames); k++) {
        PyObject *kw = PyTuple_GET_ITEM(kwnames, k);
        int at = exchange_argument(self->state, kw);
        if (at < 0)
            return PyErr_Format(PyExc_TypeError, "exchange() got an unexpected keyword argument %R", kw);
        if (at < nargs)
            return PyErr_Format(PyExc_TypeError, "exchange() got multiple values for argument %R", kw);
        given[at] = args[nargs + k];
    }
    PyObject **tensors = given;
    PyObject *mode_obj = given[MP_NUM_SLOTS], *prev_obj = given[MP_NUM_SLOTS + 1], *next_obj = given[MP_NUM_SLOTS + 2];
    const char *call = NULL;
    if (given[MP_NUM_SLOTS + 3] != Py_None) {
        if (!PyUnicode_Check(given[MP_NUM_SLOTS + 3]))
            return PyErr_Format(PyExc_TypeError, "exchange() argument 'call' must be str or None, not %.100s",
                                Py_TYPE(given[MP_NUM_SLOTS + 3])->tp_name);
        if (!(call = PyUnicode_AsUTF8(given[MP_NUM_SLOTS + 3])))
            return NULL;
    }
    mp_mode mode = MP_MODE_PARITY;
    if (mode_obj && parse_mode(mode_obj, &mode) < 0)
        return NULL;
    if (mp_comm_check_usable(self) < 0)
        return NULL;
    int prev = (self->group_rank + self->size - 1) % self->size;
    int next = (self->group_rank + 1) % self->size;
    if (prev_obj != Py_None && (prev = mp_comm_group_rank(self, prev_obj, "prev_rank")) < 0)
        return NULL;
    if (next_obj != Py_None && (next = mp_comm_group_rank(self, next_obj, "next_rank")) < 0)
        return NULL;

    pending_op slot_ops[MP_NUM_SLOTS];
    mp_plan_input in = {.mode = mode, .nlanes = self->nlanes, .rank = self->group_rank,
                        .prev_is_self = prev == self->group_rank, .next_is_self = next == self->group_rank};
    for (int s = 0; s < MP_NUM_SLOTS; s++) {
        if (tensors[s] == Py_None)
            continue;
        pending_op *p = &slot_ops[s];
        if (mp_read_tensor(self->state, tensors[s], mp_slot_name((mp_slot)s), self->device, &p->buf) < 0)
            return NULL;
        p->tensor = tensors[s];
        p->kind = mp_slot_is_send((mp_slot)s) ? MP_SEND : MP_RECV;
        p->label = (mp_label)s; /* the first four labels are the slots */
        p->peer = (s == MP_SEND_NEXT || s == MP_RECV_NEXT) ? next : prev;
        p->lane = mp_slot_lane((mp_slot)s, self->nlanes);
        in.present |= 1u << s;
    }
    mp_plan plan;
    mp_plan_exchange(&in, &plan);
    pending_op steps[MP_NUM_SLOTS][MP_NUM_SLOTS];
    step_plan plans[MP_NUM_SLOTS];
    for (int i = 0; i < plan.nsteps; i++) {
        for (int j = 0; j < plan.steps[i].nops; j++)
            steps[i][j] = slot_ops[plan.steps[i].ops[j]];
        if (check_self_pairs(self, steps[i], plan.steps[i].nops) < 0)
            return NULL;
        plans[i] = (step_plan){.ops = steps[i], .nops = plan.steps[i].nops, .lane = plan.steps[i].lane};
    }

    mp_comm_prune(self);
    PyObject *result = PyDict_New();
    if (!result || begin_posting(self) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    RequestObject *reqs[MP_NUM_SLOTS];
    int rc = post_steps(self, plans, plan.nsteps, call, reqs);
    end_posting(self); /* also after a failure: what was posted must be fenced */
    self->calls++;
    if (rc < 0) {
        Py_DECREF(result);
        return NULL;
    }
    for (int i = 0, k = 0; i < plan.nsteps; i++)
        for (int j = 0; j < plan.steps[i].nops; j++, k++) {
            if (result && PyDict_SetItem(result, self->state->slot_names[plan.steps[i].ops[j]], (PyObject *)reqs[k]) < 0)
                Py_CLEAR(result);
            Py_DECREF(reqs[k]);
        }
    return result;
}

static int read_p2p_op(CommObject *self, PyObject *tensor, PyObject *peer, mp_kind kind, const char *what,
                       pending_op *out)
{
    if (mp_read_tensor(self->state, tensor, what, self->device, &out->buf) < 0)
        return -1;
    if ((out->peer = mp_comm_group_rank(self, peer, "peer")) < 0)
        return -1;
    out->tensor = tensor;
    out->kind = kind;
    out->label = kind == MP_SEND ? MP_LABEL_ISEND : MP_LABEL_IRECV;
    out->lane = 0;
    return 0;
}

static PyObject *single_op(CommObject *self, PyObject *args, PyObject *kwargs, mp_kind kind)
{
    static char *kwlist[] = {"tensor", "peer", "call", NULL};
    PyObject *tensor, *peer;
    const char *call = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, kind == MP_SEND ? "OO|$z:isend" : "OO|$z:irecv", kwlist, &tensor,
                                     &peer, &call))
        return NULL;
    if (mp_comm_check_usable(self) < 0)
        return NULL;
    pending_op op;
    if (read_p2p_op(self, tensor, peer, kind, "tensor", &op) < 0 || check_self_pairs(self, &op, 1) < 0)
        return NULL;
    mp_comm_prune(self);
    if (begin_posting(self) < 0)
        return NULL;
    RequestObject *req;
    step_plan plan = {.ops = &op, .nops = 1, .lane = 0};
    int rc = post_steps(self, &plan, 1, call, &req);
    end_posting(self);
    self->calls++;
    return rc < 0 ? NULL : (PyObject *)req;
}

PyObject *mp_comm_isend(CommObject *self, PyObject *args, PyObject *kwargs) { return single_op(self, args, kwargs, MP_SEND); }
PyObject *mp_comm_irecv(CommObject *self, PyObject *args, PyObject *kwargs) { return single_op(self, args, kwargs, MP_RECV); }

PyObject *mp_comm_batch(CommObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"ops", "lane", "call", NULL};
    PyObject *arg, *lane_obj = NULL;
    const char *call = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$Oz:batch", kwlist, &arg, &lane_obj, &call))
        return NULL;
    int overflow = 0;
    long lane = lane_obj ? PyLong_AsLongAndOverflow(lane_obj, &overflow) : 0;
    if (lane == -1 && PyErr_Occurred())
        return NULL;
    if (overflow || lane < 0 || lane >= self->nlanes)
        return PyErr_Format(PyExc_ValueError, "lane must be 0%s for this communicator of %d lane(s), got %R",
                            self->nlanes > 1 ? " or 1" : "", self->nlanes, lane_obj);
    PyObject *seq = PySequence_Fast(arg, "batch() takes a sequence of (is_send, tensor, peer) tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    pending_op *ops = PyMem_Calloc((size_t)(n ? n : 1), sizeof(pending_op));
    PyObject *reqs = NULL;
    if (!ops) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "batch() needs at least one op");
        goto done;
    }
    if (n > 65536) {
        PyErr_Format(PyExc_ValueError, "batch() takes at most 65536 ops, got %zd", n);
        goto done;
    }
    if (mp_comm_check_usable(self) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_Format(PyExc_TypeError, "batch()[%zd] must be an (is_send, tensor, peer) tuple", i);
            goto done;
        }
        int is_send = PyObject_IsTrue(PyTuple_GET_ITEM(item, 0));
        char what[48];
        snprintf(what, sizeof what, "ops[%zd].tensor", i);
        if (is_send < 0 || read_p2p_op(self, PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2),
                                       is_send ? MP_SEND : MP_RECV, what, &ops[i]) < 0)
            goto done;
    }
    if (check_self_pairs(self, ops, (int)n) < 0)
        goto done;
    mp_comm_prune(self);
    if (begin_posting(self) < 0)
        goto done;
    RequestObject **made = PyMem_Calloc((size_t)n, sizeof *made);
    step_plan plan = {.ops = ops, .nops = (int)n, .lane = (int)lane};
    int rc = made ? post_steps(self, &plan, 1, call, made) : (PyErr_NoMemory(), -1);
    end_posting(self);
    self->calls++;
    if (rc == 0 && (reqs = PyList_New(n)))
        for (Py_ssize_t i = 0; i < n; i++)
            PyList_SET_ITEM(reqs, i, (PyObject *)made[i]);
    else if (rc == 0)
        for (Py_ssize_t i = 0; i < n; i++)
            Py_DECREF(made[i]);
    PyMem_Free(made);
done:
    PyMem_Free(ops);
    Py_DECREF(seq);
    return reqs;
}
