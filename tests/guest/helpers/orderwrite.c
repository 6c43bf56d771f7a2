// SPDX-License-Identifier: GPL-2.0-only
/*
 * Overlapping writes in flight together, for test_concurrency.py: a write
 * submitted after another to the same block must win, whatever each one's
 * content costs the target (a duplicate is mapped at once, new data only
 * after its data write, zeros without any).
 *
 *   orderwrite DEV ROUNDS SEED
 *	Four duplicate patterns are written to blocks 4*ROUNDS..+3 first.
 *	Round r: WRITES O_DIRECT writes, each of 1 to 4 blocks within blocks
 *	4r..4r+3, are submitted in one io_submit call (so they reach the
 *	target in that order) and reaped together. Each block of each write
 *	holds new content, a duplicate pattern or zeros. Then every block of
 *	the round must read back as the last write that covered it gave it
 *	(zeros if none did).
 *
 * Uses the raw aio system calls, so it needs no libaio. Exit 0: as
 * expected; 1: wrong data read back (printed); 2: usage or I/O.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "helpers.h"

#define SPAN 4		/* blocks per round */
#define WRITES 8	/* writes in flight per round */
#define NDUP 4

int main(int argc, char **argv)
{
	static unsigned char dup[NDUP][BLK] __attribute__((aligned(BLK)));
	static unsigned char buf[WRITES][SPAN][BLK] __attribute__((aligned(BLK)));
	static unsigned char got[SPAN][BLK] __attribute__((aligned(BLK)));
	struct iocb cb[WRITES], *cbs[WRITES];
	struct io_event ev[WRITES];
	const unsigned char *want[SPAN];
	long rounds, r, bad = 0, done;
	aio_context_t ctx = 0;
	uint64_t seed, rnd;
	int fd, i, b, k, n;
	unsigned char *zero;

	if (argc != 4)
		return fprintf(stderr, "usage: orderwrite DEV ROUNDS SEED\n"), 2;
	rounds = atol(argv[2]);
	seed = strtoull(argv[3], NULL, 0);
	zero = calloc(1, BLK);
	fd = open(argv[1], O_RDWR | O_DIRECT);
	if (fd < 0 || !zero)
		die(argv[1]);
	for (k = 0; k < NDUP; k++) {
		fill(dup[k], seed, ~(uint64_t)k);
		if (pwrite(fd, dup[k], BLK, (SPAN * rounds + k) * BLK) != BLK)
			die("pwrite");
	}
	if (syscall(SYS_io_setup, WRITES, &ctx))
		die("io_setup");
	rnd = mix(seed);
	for (r = 0; r < rounds; r++) {
		for (b = 0; b < SPAN; b++)
			want[b] = zero;
		for (i = 0; i < WRITES; i++) {
			int first, len;

			rnd = mix(rnd + i);
			first = rnd % SPAN;
			len = 1 + (rnd >> 8) % (SPAN - first);
			for (b = 0; b < len; b++) {
				unsigned int kind = (rnd >> (16 + 4 * b)) % 8;

				if (kind < 3)
					fill(buf[i][b], seed, (r * WRITES + i) * SPAN + b);
				else if (kind < 7)
					memcpy(buf[i][b], dup[kind - 3], BLK);
				else
					memset(buf[i][b], 0, BLK);
				want[first + b] = buf[i][b];
			}
			memset(&cb[i], 0, sizeof(cb[i]));
			cb[i].aio_fildes = fd;
			cb[i].aio_lio_opcode = IOCB_CMD_PWRITE;
			cb[i].aio_buf = (uintptr_t)buf[i][0];
			cb[i].aio_nbytes = (uint64_t)len * BLK;
			cb[i].aio_offset = (uint64_t)(SPAN * r + first) * BLK;
			cbs[i] = &cb[i];
		}
		for (i = 0; i < WRITES; i += n) {
			n = syscall(SYS_io_submit, ctx, WRITES - i, cbs + i);
			if (n <= 0)
				die("io_submit");
		}
		for (done = 0; done < WRITES; done += n) {
			n = syscall(SYS_io_getevents, ctx, 1, WRITES - done, ev, NULL);
			if (n <= 0)
				die("io_getevents");
			for (k = 0; k < n; k++) {
				struct iocb *c = (struct iocb *)(uintptr_t)ev[k].obj;

				if (ev[k].res != (int64_t)c->aio_nbytes) {
					fprintf(stderr, "write failed: %lld\n",
						(long long)ev[k].res);
					exit(2);
				}
			}
		}
		if (pread(fd, got, sizeof(got), SPAN * r * BLK) != sizeof(got))
			die("pread");
		for (b = 0; b < SPAN; b++) {
			if (!memcmp(got[b], want[b], BLK))
				continue;
			if (bad++ < 10)
				printf("block %ld: not what the last write to it wrote\n",
				       SPAN * r + b);
		}
	}
	printf("%ld rounds of %d overlapping writes, %ld blocks wrong\n",
	       rounds, WRITES, bad);
	return bad ? 1 : 0;
}
