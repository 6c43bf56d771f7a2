/* Userspace stand-in, see ../kshim.h; system headers reach it too. */
#include <asm/errno.h>
#include "../kshim.h"
