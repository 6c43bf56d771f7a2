/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Metadata block manager: checksummed, self-identifying 4 KiB blocks on the
 * metadata device, cached by dm-bufio, shadowed (copied on write) so that a
 * block the last commit references is never written again.
 */
#ifndef DM_DEDUP_BLOCK_H
#define DM_DEDUP_BLOCK_H

#include <linux/blkdev.h>
#include <linux/spinlock.h>
#include <linux/types.h>

#include "dedup-format.h"
#include "dedup-space.h"

struct dm_bufio_client;
struct dm_buffer;
struct task_struct;

/* Write-outs told apart from background writeback; more are flagged. */
#define DD_BM_OUT_TASKS		4

struct dd_bm {
	struct dm_bufio_client *bufio;
	struct block_device *bdev;	/* for the journal's direct I/O */
	struct dd_space space;		/* which metadata blocks are in use */
	u64 nr_blocks;
	u64 txn;			/* id of the running transaction */
	/*
	 * Blocks the running transaction allocated: only these may change
	 * in place, and only these may carry its id. Kept here rather than
	 * trusted from a block's header, which may be stale or damaged.
	 * Bits outside [fresh_lo, fresh_hi) are clear.
	 */
	unsigned long *fresh;
	u64 fresh_lo, fresh_hi;
	const char *name;		/* the device's, for log lines */
	/*
	 * The threads in dd_bm_write_all() or a write-ahead: any other
	 * thread's write is background writeback, even while one of them
	 * runs (its error may come after theirs was taken).
	 */
	spinlock_t out_lock;
	struct task_struct *out_tasks[DD_BM_OUT_TASKS];
	int ahead_error;		/* a write-ahead's, for the write-out */
	unsigned long flags;		/* DD_BM_* bits */
};

/* dm-bufio wrote a block on its own since the last dd_bm_write_all(). */
#define DD_BM_BACKGROUND_WRITE	0

/* A metadata block held in the cache. */
struct dd_block {
	struct dm_buffer *buf;
	void *data;
	u64 nr;
};

/* What a caller expects to find in a block; any mismatch is corruption. */
struct dd_block_kind {
	u32 type;
	u8 array;
	u8 level;
};

int dd_bm_create(struct block_device *bdev, u64 nr_blocks, struct dd_bm **bmp);
void dd_bm_destroy(struct dd_bm *bm);

int dd_bm_read(struct dd_bm *bm, u64 nr, const struct dd_block_kind *kind,
	       struct dd_block *blk);
int dd_bm_read_cached(struct dd_bm *bm, u64 nr,
		      const struct dd_block_kind *kind, struct dd_block *blk);
int dd_bm_read_raw(struct dd_bm *bm, u64 nr, struct dd_block *blk);
int dd_bm_new(struct dd_bm *bm, const struct dd_block_kind *kind,
	      struct dd_block *blk);
int dd_bm_shadow(struct dd_bm *bm, u64 nr, const struct dd_block_kind *kind,
		 struct dd_block *blk);
bool dd_bm_is_fresh(const struct dd_bm *bm, u64 nr);
void dd_bm_prefetch(struct dd_bm *bm, u64 nr, u64 count);
void dd_bm_release(struct dd_block *blk);
void dd_bm_release_dirty(struct dd_block *blk);

int dd_bm_write_all(struct dd_bm *bm);
void dd_bm_write_ahead(struct dd_bm *bm);
bool dd_bm_background_writes(struct dd_bm *bm);
int dd_bm_writeback_error(struct dd_bm *bm);
void dd_bm_next_txn(struct dd_bm *bm);
void dd_bm_settle(struct dd_bm *bm);
int dd_bm_write_super(struct dd_bm *bm, const struct dd_superblock *sb);
/*
 * I/O whose owner learns from the last completion that all of it is
 * done, without waiting for a thread to be woken: @pending counts the
 * parts not yet done, each put by the completion of the bio that ends
 * it; the put that brings it to zero calls @done, in that bio's
 * completion (interrupt context) or in the thread of a part that needed
 * no I/O, with @failed set if any part failed. A part whose I/O is never
 * issued (an error before it) is never put, and @done is never called.
 * Each put happens before its bio's waiter is woken, so an owner that
 * waits for every bio it issued may then free the group.
 */
struct dd_io_group {
	atomic_t pending;
	bool failed;
	void (*done)(struct dd_io_group *g, bool failed);
};

static inline void dd_io_group_init(struct dd_io_group *g, unsigned int parts,
				    void (*done)(struct dd_io_group *g,
						 bool failed))
{
	atomic_set(&g->pending, parts);
	g->failed = false;
	g->done = done;
}

static inline void dd_io_group_get(struct dd_io_group *g)
{
	atomic_inc(&g->pending);
}

static inline void dd_io_group_put(struct dd_io_group *g, blk_status_t status)
{
	if (status)
		WRITE_ONCE(g->failed, true);
	/* Fully ordered: the last put sees every part's failure. */
	if (atomic_dec_and_test(&g->pending))
		g->done(g, READ_ONCE(g->failed));
}

/*
 * Whole blocks past the cache, for the journal, whose blocks the trees
 * never read: @nr pages from block @first; writes carry FUA. A write's
 * last bio puts @group's part (NULL: none), once all the blocks are
 * written, or failed.
 */
int dd_bm_read_blocks(struct dd_bm *bm, u64 first, struct page **pages,
		      unsigned int nr);
int dd_bm_write_blocks(struct dd_bm *bm, u64 first, struct page **pages,
		       unsigned int nr, struct dd_io_group *group);

u32 dd_block_csum(const void *data);
bool dd_block_csum_ok(const void *data);

/*
 * A device's error as this module reports it: -EIO. The block layer's
 * errnos overlap codes that mean something here (a medium error is
 * -ENODATA, which a map lookup returns for an unmapped block and the
 * journal's take for an empty append; BLK_STS_NOSPC is -ENOSPC, a full
 * device; a protection error is -EILSEQ, damaged metadata), and a failed
 * read, write or flush must never pass for one of them. The block layer
 * logged the device's own error.
 */
static inline int dd_device_error(int r)
{
	return r ? -EIO : 0;
}

/* For log lines: the device's name; KUnit's block managers have none. */
static inline const char *dd_bm_name(const struct dd_bm *bm)
{
	return bm->name ?: "metadata";
}

static inline struct dd_block_header *dd_hdr(const struct dd_block *blk)
{
	return blk->data;
}

static inline void *dd_payload(const struct dd_block *blk)
{
	return (char *)blk->data + DD_HEADER_SIZE;
}

#endif
