/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The redo journal (format version 2): what the metadata changed since
 * its last checkpoint, as records appended to a ring of blocks on the
 * metadata device, so that a flush costs one FUA write instead of a
 * commit of the trees. Documentation/dedup-format.rst, "Journal", is
 * the format; this unit encodes, writes and replays it, and knows
 * nothing of the trees: the metadata unit notes each change and applies
 * what replay hands back.
 *
 * Locking: j->lock guards the records being collected and the ring's
 * position; it nests inside md->lock. A batch taken from it is written
 * with no lock held; the metadata's caller writes one batch at a time
 * and never a batch across a checkpoint.
 */
#ifndef DM_DEDUP_JOURNAL_H
#define DM_DEDUP_JOURNAL_H

#include <linux/mutex.h>
#include <linux/types.h>

#include "dedup-block.h"

struct page;

/* Where the journal lives and which epoch follows the state read. */
struct dd_journal_geometry {
	u64 start;
	u64 nr_blocks;
	u64 id;
	u64 epoch;
	u64 logical_blocks;	/* bounds of the record indexes */
	u64 data_blocks;
	/*
	 * The superblock has DD_SB_UNFLUSHED_APPENDS: appends are written
	 * while their data flush is on its way, marked DD_JF_UNFLUSHED.
	 */
	bool unflushed;
};

struct dd_journal {
	struct dd_bm *bm;
	struct mutex lock;	/* everything below */
	struct dd_journal_geometry geo;	/* geo.epoch: the running epoch */
	u64 next_seq;		/* where the next append starts */
	bool epoch_written;	/* a superblock of this instance has geo.epoch */
	struct page **pending;	/* blocks of records not appended yet */
	unsigned int nr_pending;
	unsigned int max_pending;
	u32 used;		/* record bytes in the last pending block */
	bool overflow;		/* records were dropped: checkpoint next */
	bool writing;		/* a batch was taken and is not written yet */
	/*
	 * The newest append was taken marked DD_JF_UNFLUSHED, and its data
	 * flush is not known to have succeeded: replay must check it. It
	 * starts at unchecked_seq.
	 */
	bool unchecked;
	u64 unchecked_seq;
	struct page **spare;	/* written blocks kept for reuse */
	unsigned int nr_spare;
	u64 appends;
	u64 blocks_written;
};

/* Blocks taken for one append; written by dd_journal_write(). */
struct dd_journal_batch {
	struct page **pages;
	unsigned int nr;
	u64 first_seq;
	/*
	 * Marked DD_JF_UNFLUSHED: it may be written while its data is being
	 * flushed. If not, the data must be flushed first.
	 */
	bool unflushed;
	/*
	 * Set by the taker after dd_journal_take(), or NULL: its part ends
	 * when the append's last block is written (see dd_io_group).
	 */
	struct dd_io_group *notify;
};

int dd_journal_init(struct dd_journal *j, struct dd_bm *bm,
		    const struct dd_journal_geometry *geo, u64 next_seq);
void dd_journal_exit(struct dd_journal *j);

void dd_journal_note(struct dd_journal *j, u8 type, u64 index,
		     const void *value, size_t len);
int dd_journal_take(struct dd_journal *j, const u64 *counters, bool counted,
		    u64 txn, struct dd_journal_batch *b);
int dd_journal_write(struct dd_journal *j, struct dd_journal_batch *b);
void dd_journal_drop_batch(struct dd_journal *j, struct dd_journal_batch *b);

/* The epoch a checkpoint written now starts: the next append's seq. */
u64 dd_journal_next_epoch(struct dd_journal *j);
/*
 * The checkpoint naming @epoch and journal id @id is on disk: the records
 * noted are in it, and appends after it carry @id. @unflushed: its
 * superblock has DD_SB_UNFLUSHED_APPENDS, so appends after it are marked
 * DD_JF_UNFLUSHED.
 */
void dd_journal_checkpointed(struct dd_journal *j, u64 epoch, u64 id,
			     bool unflushed);
/* The data the newest append points at was flushed since it was taken. */
void dd_journal_data_stable(struct dd_journal *j);
/*
 * Must a replay of the journal as written check the newest append? If
 * so, *@seq is where it starts.
 */
bool dd_journal_unchecked(struct dd_journal *j, u64 *seq);
/* Blocks appended in the running epoch, and whether records wait. */
u64 dd_journal_used(struct dd_journal *j);
bool dd_journal_pending(struct dd_journal *j);
void dd_journal_stats(struct dd_journal *j, u64 *used, u64 *appends,
		      u64 *blocks_written);

/* What replay found. */
struct dd_journal_replayed {
	u64 blocks;		/* in whole appends, applied */
	u64 appends;
	u64 records;
	u64 torn;		/* blocks after the last END, ignored */
	u64 dropped;		/* blocks of an unflushed append whose data is not there */
	u64 dropped_pba;	/* the first data block found without its data */
};

/* 1 when a block follows the epoch (replay has work), 0 if not, < 0. */
int dd_journal_has_records(struct dd_bm *bm,
			   const struct dd_journal_geometry *geo);

typedef int (*dd_journal_apply_fn)(void *ctx, u8 type, u64 index,
				   const void *value);

/*
 * Does data block @pba hold content whose fingerprint is @fp (DD_FP_SIZE
 * bytes, zero-padded)? 0 if it does, 1 if not, < 0 if it cannot be read.
 */
typedef int (*dd_journal_verify_fn)(void *ctx, u64 pba, const u8 *fp);

/*
 * Read the journal that follows the state of @geo->epoch and hand every
 * record of its whole appends to @apply, in order. -EILSEQ when a block
 * that continues the journal is malformed (damage, not its end). The
 * last append, if DD_JF_UNFLUSHED, is applied only if @verify finds the
 * data of every block it makes live (out->dropped if not); with no
 * @verify (no data device at hand) it is applied as it is. A @check_seq
 * narrows that to an append starting at *@check_seq: the writer knows
 * which append's data flush it did not see complete, and the appends
 * before it were acknowledged.
 */
int dd_journal_replay(struct dd_bm *bm, const struct dd_journal_geometry *geo,
		      dd_journal_apply_fn apply, void *ctx,
		      dd_journal_verify_fn verify, void *vctx,
		      const u64 *check_seq, struct dd_journal_replayed *out);

#endif
