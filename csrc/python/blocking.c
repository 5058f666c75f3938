/* A transport call that blocks with the GIL released: creating a communicator, a host wait.
 * Its mp_interrupt hook takes the GIL back every SIGNAL_CHECK_PERIOD to run Python's signal
 * handlers (Ctrl-C, a SIGUSR1 trace dump), and, during creation, to ask whether another member's
 * creation failed. The transport keeps its own state across those turns: one call, one wait. */
#include "bindings.h"

#include "core/clock.h"

#define SIGNAL_CHECK_PERIOD 0.05

static int blocking_interrupted(void *arg)
{
    mp_blocking *b = arg;
    double now = mp_now();
    if (now < b->next_check)
        return 0;
    b->next_check = now + SIGNAL_CHECK_PERIOD;
    PyEval_RestoreThread(b->saved);
    int stop = PyErr_CheckSignals() < 0;
    if (!stop && b->peer_failed) {
        PyObject *why = PyObject_CallNoArgs(b->peer_failed);
        stop = !why || why != Py_None;
        if (why && why != Py_None)
            PyErr_SetObject(b->error, why);
        Py_XDECREF(why);
    }
    b->saved = PyEval_SaveThread();
    return stop;
}

void mp_blocking_begin(mp_blocking *b, mp_interrupt *interrupt)
{
    b->next_check = mp_now() + SIGNAL_CHECK_PERIOD;
    interrupt->raised = blocking_interrupted;
    interrupt->arg = b;
    b->saved = PyEval_SaveThread();
}

void mp_blocking_end(mp_blocking *b)
{
    PyEval_RestoreThread(b->saved);
}
