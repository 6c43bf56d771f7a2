# dm-dedup: top-level build.
#
#   make              build dm-dedup/dm-dedup.ko against the 6.12 headers
#   make KDIR=...     build against another kernel tree
#   make static       W=1 and sparse (C=1) builds, checkpatch --strict
#   make kunit        KUnit suite under UML (scripts/kunit.sh)
#   make test         every test (installs what it needs)
#   make torture TRIALS=N   the long crash and corruption run (default 4, ~2.5 h)
#   make demo         the main demo in a guest
#   make bench        raw, dm-thin, dm-vdo and dm-dedup side by side (45 min to 2 h)
#   make install      install the module into /lib/modules/$(KVER)

KVER ?= $(shell ls -d /usr/src/linux-headers-6.12.*-amd64 2>/dev/null | \
	  sort -V | tail -n 1 | sed 's,.*/linux-headers-,,')
KDIR ?= /usr/src/linux-headers-$(KVER)
MOD_DIR := $(CURDIR)/dm-dedup
CHECKPATCH ?= $(firstword $(wildcard /usr/src/linux-source-6.12/scripts/checkpatch.pl) \
		$(KDIR)/scripts/checkpatch.pl)

.PHONY: all module static w1 sparse checkpatch kunit test torture demo demo-copy bench fresh-check install clean

all: module

module:
	@test -d "$(KDIR)" || { echo "kernel headers not found at '$(KDIR)': run scripts/install-deps.sh or set KDIR" >&2; exit 1; }
	$(MAKE) -C $(KDIR) M=$(MOD_DIR) modules

# The build's own exit status counts (a recipe's shell has no pipefail,
# so a pipe into tee would hide it), then any warning in its output.
w1:
	$(MAKE) -C $(KDIR) M=$(MOD_DIR) clean >/dev/null
	{ $(MAKE) -C $(KDIR) M=$(MOD_DIR) W=1 modules 2>&1; echo $$? >$(MOD_DIR)/.w1.rc; } | tee $(MOD_DIR)/.w1.log
	@test "$$(cat $(MOD_DIR)/.w1.rc)" = 0 || { echo "W=1 build failed" >&2; exit 1; }
	@! grep -E 'warning:|error:' $(MOD_DIR)/.w1.log

sparse:
	@command -v sparse >/dev/null || { echo "sparse not found: run scripts/install-deps.sh" >&2; exit 1; }
	{ $(MAKE) -C $(KDIR) M=$(MOD_DIR) C=2 modules 2>&1; echo $$? >$(MOD_DIR)/.sparse.rc; } | tee $(MOD_DIR)/.sparse.log
	@test "$$(cat $(MOD_DIR)/.sparse.rc)" = 0 || { echo "sparse build failed" >&2; exit 1; }
	@! grep -E 'warning:|error:' $(MOD_DIR)/.sparse.log

checkpatch:
	$(CHECKPATCH) --strict --no-tree --quiet --show-types \
		--ignore SPDX_LICENSE_TAG,FILE_PATH_CHANGES -f $(filter-out %.mod.c,$(wildcard $(MOD_DIR)/*.[ch]))

static: w1 sparse checkpatch

kunit:
	scripts/kunit.sh

test:
	tests/run-all.sh

TRIALS ?= 4
torture:
	scripts/torture.sh $(TRIALS)

demo:
	scripts/demo.sh

demo-copy:
	DEMO=copy scripts/demo.sh

bench:
	scripts/bench.sh

fresh-check:
	scripts/fresh-check.sh

install: module
	$(MAKE) -C $(KDIR) M=$(MOD_DIR) INSTALL_MOD_DIR=updates modules_install
	depmod -a $(KVER)

clean:
	$(MAKE) -C $(KDIR) M=$(MOD_DIR) clean
	rm -f $(MOD_DIR)/.w1.log $(MOD_DIR)/.sparse.log
