/* Bindings of the offline simulator (filled in by the simulator work). */
#include "bindings.h"

PyMethodDef mp_simulate_methods[] = {
    {NULL},
};
