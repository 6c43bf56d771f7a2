/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Data blocks the target owns.
 *
 * A write's 4 KiB is copied into a page of ours before anything is
 * decided about it. The submitter's pages are not ours to trust: an
 * O_DIRECT or io_uring buffer belongs to the user and may change while the
 * write is in flight, and without stable writes so may a page-cache page
 * under writeback. The zero test, the fingerprint, a verify compare and
 * the data write all read the copy, so the fingerprint always describes
 * the bytes that reach the data device.
 *
 * The copies come from a mempool so that writes make progress under
 * memory pressure; a block holds its copy until it is done, which never
 * needs another copy. Pages given back are kept for reuse (up to 4 MiB
 * per device): a fresh page from the allocator is zeroed first when the
 * kernel runs with init_on_alloc (Debian's default), only for the copy
 * to overwrite it.
 *
 * Stored data blocks are read back here too, outside the bio flow: the
 * candidates that verify compares, and the journal's newest append.
 *
 * Under verify, the copies of blocks stored lately are kept a while
 * after their write (one per slot, by physical block number; 256 KiB
 * per device): a copy of a block just written, which a VM clone or a
 * database log writes soon after the first, is then compared with it in
 * memory instead of reading it back.
 */
#ifndef DM_DEDUP_DATA_H
#define DM_DEDUP_DATA_H

#include <linux/completion.h>
#include <linux/mempool.h>
#include <linux/mutex.h>
#include <linux/spinlock.h>
#include <linux/types.h>

struct bio;
struct bio_set;
struct block_device;
struct page;

/* Copies of stored blocks kept for verify, at most (a power of two). */
#define DD_DATA_STORED	64

/* The copy of one stored block (dd_data_keep_stored). */
struct dd_data_stored {
	spinlock_t lock;	/* protects the three below */
	u64 pba;
	u64 tag;
	struct page *page;
};

struct dd_data_pool {
	mempool_t pages;
	struct mutex reserve_lock;	/* one writer at a time takes the reserve */
	spinlock_t kept_lock;		/* protects the two below */
	struct list_head kept;		/* pages given back, for reuse */
	unsigned int nr_kept;
	struct dd_data_stored stored[DD_DATA_STORED];
};

int dd_data_pool_init(struct dd_data_pool *pool, unsigned int reserve);
void dd_data_pool_exit(struct dd_data_pool *pool);

/*
 * Copies of the @nr 4 KiB blocks @bio carries, in @pages[0..nr), however
 * its segments are cut. May sleep; never fails.
 */
void dd_data_copy(struct dd_data_pool *pool, struct bio *bio,
		  struct page **pages, unsigned int nr);
void dd_data_put(struct dd_data_pool *pool, struct page *page);

/*
 * @page holds what physical block @pba holds, for as long as the
 * caller's @tag stands (dm-dedup: until a commit lets freed blocks be
 * written again; tags only grow): kept for dd_data_stored_compare(), and
 * no longer the caller's. Under memory pressure it goes back to the
 * pool instead, and so does the copy its slot held.
 */
void dd_data_keep_stored(struct dd_data_pool *pool, u64 pba, u64 tag,
			 struct page *page);

/* What a kept copy tells of a physical block's bytes. */
enum dd_data_kept {
	DD_KEPT_NONE,		/* no copy of it kept with the tag: read it */
	DD_KEPT_SAME,		/* it holds @page's bytes */
	DD_KEPT_DIFFERENT,	/* it holds other bytes: no read needed */
};

/*
 * Does a copy kept with @tag show whether @pba holds @page's bytes? A
 * copy found with an older tag is let go.
 */
enum dd_data_kept dd_data_stored_compare(struct dd_data_pool *pool, u64 pba,
					 u64 tag, struct page *page);

bool dd_data_is_zero(struct page *page);
bool dd_data_equal(struct page *a, struct page *b);

/*
 * Whom a data bio is made for: the cgroup and I/O priority of the write
 * it stores or whose candidate it reads, so that limits such as io.max
 * and the I/O scheduler count it as that writer's.
 */
struct dd_data_owner {
	struct cgroup_subsys_state *css;	/* NULL: the worker's */
	unsigned short ioprio;
};

/*
 * A bio made with a device is the submitting task's (a worker's): make
 * it @owner's. A NULL @owner leaves it the worker's.
 */
void dd_data_own(struct bio *bio, const struct dd_data_owner *owner);

int dd_data_read_block(struct block_device *bdev, u64 pba, struct page *page,
		       const struct dd_data_owner *owner);

/* Blocks dd_data_read() reads in one call, at most. */
#define DD_DATA_READS	64

/* One bio of dd_data_read(): a run of consecutive blocks. */
struct dd_data_run {
	struct dd_data_reads *reads;
	int *error;		/* where the run's blocks' results go */
	unsigned int len;
};

/* What dd_data_read() keeps while its reads are in flight. */
struct dd_data_reads {
	atomic_t pending;
	struct completion done;
	struct dd_data_run run[DD_DATA_READS];
};

unsigned int dd_data_read(struct block_device *bdev, struct bio_set *bs,
			  const u64 *pba, struct page **page, int *error,
			  unsigned int nr, struct dd_data_reads *rd,
			  const struct dd_data_owner *owner);

#endif
