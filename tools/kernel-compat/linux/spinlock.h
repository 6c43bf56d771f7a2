/* Userspace stand-in, see ../kshim.h. */
#include "../kshim.h"
