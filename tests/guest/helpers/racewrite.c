// SPDX-License-Identifier: GPL-2.0-only
/*
 * Writers whose pages change while the write is in flight, for
 * test_integrity.py: the dedup target must fingerprint exactly the bytes
 * it stores, whatever the submitter does to its buffer meanwhile.
 *
 *   racewrite direct DEV ROUNDS SEED
 *	Round r: an O_DIRECT write of content A_r to block 3r while a second
 *	thread keeps rewriting the buffer between A_r and B_r; then A_r
 *	written normally to block 3r+1 and B_r to 3r+2. At the end every
 *	normally written block is read back: it must hold what was written,
 *	and block 3r must hold, byte by byte, A_r or B_r.
 *
 *   racewrite mmap FILE PAGES SECONDS SEED OUT
 *	Stores whole 4 KiB patterns (16 of them, so most pages duplicate
 *	others) into a shared mapping of FILE while a second thread keeps
 *	calling fdatasync, so pages change under writeback. Then a final
 *	msync and fsync; OUT gets the pattern each page holds last, one
 *	number a line.
 *
 *   racewrite mmap-verify FILE PAGES SEED OUT
 *	After a remount: every page of FILE holds the pattern OUT names.
 *
 * Exit 0: as expected; 1: wrong data read back (printed); 2: usage or I/O.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "helpers.h"

#define NPAT 16

static void *aligned_block(size_t n)
{
	void *p;

	if (posix_memalign(&p, BLK, n * BLK))
		die("posix_memalign");
	return p;
}

/* ---- direct ------------------------------------------------------ */

struct flipper {
	unsigned char *buf;
	const unsigned char *a, *b;
	atomic_int stop;
	atomic_long flips;
};

static void *flip(void *arg)
{
	struct flipper *f = arg;

	while (!atomic_load_explicit(&f->stop, memory_order_relaxed)) {
		memcpy(f->buf, f->b, BLK);
		memcpy(f->buf, f->a, BLK);
		atomic_fetch_add_explicit(&f->flips, 1, memory_order_relaxed);
	}
	return NULL;
}

static void pwrite_block(int fd, const void *buf, uint64_t lba)
{
	if (pwrite(fd, buf, BLK, lba * BLK) != BLK)
		die("pwrite");
}

static int run_direct(const char *dev, long rounds, uint64_t seed)
{
	unsigned char *buf = aligned_block(1), *io = aligned_block(1);
	unsigned char *a = aligned_block(1), *b = aligned_block(1);
	long r, bad = 0, torn = 0, foreign = 0, i, start;
	struct flipper f = { .buf = buf, .a = a, .b = b };
	pthread_t t;
	int fd;

	fd = open(dev, O_RDWR | O_DIRECT);
	if (fd < 0)
		die(dev);
	for (r = 0; r < rounds; r++) {
		fill(a, seed, 2 * r);
		fill(b, seed, 2 * r + 1);
		memcpy(buf, a, BLK);
		atomic_store(&f.stop, 0);
		start = atomic_load(&f.flips);
		if (pthread_create(&t, NULL, flip, &f))
			die("pthread_create");
		/* let the flipper get going before the write starts */
		while (atomic_load(&f.flips) < start + 2)
			;
		pwrite_block(fd, buf, 3 * r);
		atomic_store(&f.stop, 1);
		pthread_join(t, NULL);
		memcpy(io, a, BLK);
		pwrite_block(fd, io, 3 * r + 1);
		memcpy(io, b, BLK);
		pwrite_block(fd, io, 3 * r + 2);
	}
	if (fsync(fd))
		die("fsync");
	for (r = 0; r < rounds; r++) {
		fill(a, seed, 2 * r);
		fill(b, seed, 2 * r + 1);
		if (pread(fd, io, BLK, (3 * r + 1) * BLK) != BLK)
			die("pread");
		if (memcmp(io, a, BLK)) {
			printf("round %ld: block %ld was written with A and reads other bytes\n",
			       r, 3 * r + 1);
			bad++;
		}
		if (pread(fd, io, BLK, (3 * r + 2) * BLK) != BLK)
			die("pread");
		if (memcmp(io, b, BLK)) {
			printf("round %ld: block %ld was written with B and reads other bytes\n",
			       r, 3 * r + 2);
			bad++;
		}
		if (pread(fd, io, BLK, 3 * r * BLK) != BLK)
			die("pread");
		if (memcmp(io, a, BLK) && memcmp(io, b, BLK))
			torn++;
		for (i = 0; i < BLK; i++)
			if (io[i] != a[i] && io[i] != b[i])
				break;
		if (i < BLK) {
			printf("round %ld: raced block %ld holds bytes of neither A nor B\n",
			       r, 3 * r);
			foreign++;
		}
	}
	printf("direct: rounds %ld flips %ld wrong %ld torn_raced %ld foreign_raced %ld\n",
	       rounds, atomic_load(&f.flips), bad, torn, foreign);
	close(fd);
	return bad || foreign ? 1 : 0;
}

/* ---- mmap -------------------------------------------------------- */

struct syncer {
	int fd;
	atomic_int stop;
	atomic_long syncs;
};

static void *sync_loop(void *arg)
{
	struct syncer *s = arg;

	while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
		if (fdatasync(s->fd))
			die("fdatasync");
		atomic_fetch_add_explicit(&s->syncs, 1, memory_order_relaxed);
	}
	return NULL;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int run_mmap(const char *path, long pages, double seconds,
		    uint64_t seed, const char *out)
{
	unsigned char (*pat)[BLK] = aligned_block(NPAT);
	struct syncer s = { 0 };
	unsigned char *map;
	long *last, stores = 0, p, j;
	uint64_t rnd = seed;
	double end;
	pthread_t t;
	FILE *o;

	for (j = 0; j < NPAT; j++)
		fill(pat[j], seed, j);
	last = calloc(pages, sizeof(*last));
	s.fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
	if (!last || s.fd < 0)
		die(path);
	if (ftruncate(s.fd, pages * BLK))
		die("ftruncate");
	map = mmap(NULL, pages * BLK, PROT_READ | PROT_WRITE, MAP_SHARED,
		   s.fd, 0);
	if (map == MAP_FAILED)
		die("mmap");
	for (p = 0; p < pages; p++) {
		memcpy(map + p * BLK, pat[p % NPAT], BLK);
		last[p] = p % NPAT;
	}
	if (pthread_create(&t, NULL, sync_loop, &s))
		die("pthread_create");
	end = now() + seconds;
	while (now() < end) {
		for (j = 0; j < 64; j++) {
			rnd = mix(rnd);
			p = rnd % pages;
			last[p] = (rnd >> 32) % NPAT;
			memcpy(map + p * BLK, pat[last[p]], BLK);
			stores++;
		}
	}
	atomic_store(&s.stop, 1);
	pthread_join(t, NULL);
	if (msync(map, pages * BLK, MS_SYNC) || fsync(s.fd))
		die("msync/fsync");
	printf("mmap: pages %ld stores %ld syncs %ld\n", pages, stores,
	       atomic_load(&s.syncs));
	o = fopen(out, "w");
	if (!o)
		die(out);
	for (p = 0; p < pages; p++)
		fprintf(o, "%ld\n", last[p]);
	fclose(o);
	munmap(map, pages * BLK);
	close(s.fd);
	return 0;
}

static int run_mmap_verify(const char *path, long pages, uint64_t seed,
			   const char *out)
{
	unsigned char (*pat)[BLK] = aligned_block(NPAT);
	unsigned char *io = aligned_block(1);
	long p, j, bad = 0;
	FILE *o;
	int fd;

	for (j = 0; j < NPAT; j++)
		fill(pat[j], seed, j);
	o = fopen(out, "r");
	fd = open(path, O_RDONLY | O_DIRECT);
	if (!o || fd < 0)
		die("open");
	for (p = 0; p < pages; p++) {
		if (fscanf(o, "%ld", &j) != 1 || j < 0 || j >= NPAT)
			die("pattern list");
		if (pread(fd, io, BLK, p * BLK) != BLK)
			die("pread");
		if (memcmp(io, pat[j], BLK)) {
			printf("page %ld: should hold pattern %ld, reads other bytes\n",
			       p, j);
			bad++;
		}
	}
	printf("mmap-verify: pages %ld wrong %ld\n", pages, bad);
	fclose(o);
	close(fd);
	return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
	if (argc == 5 && !strcmp(argv[1], "direct"))
		return run_direct(argv[2], atol(argv[3]), strtoull(argv[4], NULL, 0));
	if (argc == 7 && !strcmp(argv[1], "mmap"))
		return run_mmap(argv[2], atol(argv[3]), atof(argv[4]),
				strtoull(argv[5], NULL, 0), argv[6]);
	if (argc == 6 && !strcmp(argv[1], "mmap-verify"))
		return run_mmap_verify(argv[2], atol(argv[3]),
				       strtoull(argv[4], NULL, 0), argv[5]);
	fprintf(stderr, "usage: racewrite direct DEV ROUNDS SEED\n"
			"       racewrite mmap FILE PAGES SECONDS SEED OUT\n"
			"       racewrite mmap-verify FILE PAGES SEED OUT\n");
	return 2;
}
