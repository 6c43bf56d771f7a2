/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The persistent state of a dedup device, behind verbs named after what
 * they mean: the map (logical block -> physical block), per physical block
 * a refcount and a fingerprint, and commits. Nothing outside this unit
 * knows the disk layout.
 *
 * Locking: every verb takes this unit's own lock (dedup-metadata.c), so
 * verbs may run concurrently and each one is atomic. A sequence of verbs
 * is not: a block looked up may die before the next verb, which the verbs
 * report as soft misses.
 */
#ifndef DM_DEDUP_METADATA_H
#define DM_DEDUP_METADATA_H

#include <linux/blkdev.h>
#include <linux/types.h>

#include "dedup-format.h"
#include "dedup-journal.h"
#include "dedup-space.h"

struct dd_metadata;

/* Called for each live physical block while the metadata is opened. */
typedef int (*dd_fp_visit_fn)(void *ctx, u64 pba, const u8 *fp);
/* Called by dd_md_commit for each run of physical blocks that became reusable. */
typedef void (*dd_reusable_fn)(void *ctx, u64 begin, u64 end);

/*
 * What the target keeps in RAM beside the metadata (its fingerprint
 * index): saved at a clean close (dd_md_save) with the metadata's own
 * allocation state, and loaded by the next open in place of a rebuild.
 * @words (@nr_words of them) and @head belong to the target; head[0]
 * names their layout, and a save of another layout is not loaded. The
 * open fills them (zeroed beforehand), asks cfg->saved_ok and sets
 * @loaded, or else calls cfg->visit for a rebuild and says in @why
 * what kept it from loading (NULL: nothing was saved).
 */
struct dd_md_saved {
	u64 head[DD_SAVED_TARGET_HEAD];
	u64 *words;
	u64 nr_words;
	bool loaded;
	const char *why;
};

/*
 * Whether the target takes its loaded part: 0 yes; else *why says why
 * not. @live holds the data blocks with a reference, as loaded.
 */
typedef int (*dd_saved_ok_fn)(void *ctx, const struct dd_md_saved *saved,
			      const struct dd_space *live, const char **why);

struct dd_md_config {
	const char *name;	/* the device's, for log lines; may be NULL */
	u64 logical_blocks;
	u64 data_blocks;
	const char *hash_name;
	u32 fp_size;
	bool read_only;
	/*
	 * A commit holds the data blocks it frees until dd_md_release_held,
	 * so that they can be discarded on the device outside every lock.
	 */
	bool hold_frees;
	bool identity_only;	/* check the table against it, then stop */
	/*
	 * Appends wait for their data flush (no UNFLUSHED_APPENDS): with a
	 * hash that is not collision resistant, replay's check of the newest
	 * append could take stale data for the data its records name.
	 */
	bool flush_first;
	dd_fp_visit_fn visit;
	/*
	 * Checks the data of the journal's newest append when it was
	 * written before its data was flushed; NULL: applied unchecked.
	 */
	dd_journal_verify_fn verify;
	/*
	 * Makes what the data device holds durable, before a read-write
	 * open checks that data and checkpoints what it found: a crash that
	 * kept the device's cache (a reset, a killed guest) must not leave
	 * a checked block that the next power loss takes back. NULL: none.
	 */
	int (*flush_data)(void *ctx);
	void *ctx;		/* for visit, verify and flush_data */
	struct dd_md_saved *saved;	/* may be NULL: always rebuild */
	dd_saved_ok_fn saved_ok;
};

struct dd_md_stats {
	u64 transaction_id;
	u64 metadata_used;
	u64 metadata_total;
	u64 data_used;		/* allocated, including pending frees */
	u64 data_total;
	u64 data_space_bytes;	/* RAM of the data allocator's bitmaps */
	u64 data_live;		/* refcount > 0 */
	u64 mapped;
	u64 unique_writes;
	u64 duplicate_writes;
	u64 in_place_changes;	/* shares and zero blocks, lock shared */
	u64 zero_writes;
	u64 discarded;
	u64 pending_free;
	u64 checkpoints;	/* commits of the trees by this instance */
	u64 journal_used;	/* blocks appended since the last checkpoint */
	u64 journal_total;	/* 0: format version 1, no journal */
	u64 journal_appends;
	u64 journal_blocks_written;
	u64 journal_replayed;	/* blocks replayed at activation */
	u64 journal_dropped;	/* blocks of an unflushed append dropped then */
};

#define DD_REFCOUNT_MAX		U32_MAX

/*
 * A physical block that lost its last reference in a change. The verbs
 * hand it back rather than calling out, so the caller drops it from its
 * index in its own context and order.
 */
struct dd_md_freed {
	u64 pba;
	u8 fp[DD_FP_SIZE];
};

u64 dd_md_required_blocks(u64 logical_blocks, u64 data_blocks);

int dd_md_open(struct block_device *bdev, const struct dd_md_config *cfg,
	       struct dd_metadata **mdp, char **error);
void dd_md_close(struct dd_metadata *md);

int dd_md_lookup(struct dd_metadata *md, u64 lba, u64 *pba, bool nowait);
/*
 * The run of logical blocks from @lba (at most @max) that reads from one
 * place: 0 with *pba the first physical block of a run mapped to
 * consecutive physical blocks, or -ENODATA for a run of unmapped blocks.
 * *nr >= 1 is the run's length. Only the first lookup may wait for a
 * metadata read (unless @nowait); the run ends where the next would.
 */
int dd_md_lookup_run(struct dd_metadata *md, u64 lba, u64 max, u64 *pba,
		     u64 *nr, bool nowait);
int dd_md_get_fingerprint(struct dd_metadata *md, u64 pba, u8 *fp);
int dd_md_get_refcount(struct dd_metadata *md, u64 pba, u32 *count);

/*
 * 1 when @pba is live and its fingerprint record equals @fp (DD_FP_SIZE
 * bytes), else 0; < 0 on error. While the caller keeps commits out, a
 * block found live keeps its content: a freed block is reused only after
 * a commit.
 */
int dd_md_holds(struct dd_metadata *md, u64 pba, const u8 *fp);

/* Holders of one content in one leaf that a search looks at, at most. */
#define DD_MD_HOLDERS_MAX	8
/*
 * The live blocks whose fingerprint record is in leaf @leaf of the
 * fingerprint array (blocks leaf * DD_FP_PER_LEAF onwards) and equals @fp
 * (DD_FP_SIZE bytes), at most @max of them (and DD_MD_HOLDERS_MAX), into
 * @pba: how many, < 0 on error. The fingerprint index names leaves, not
 * blocks. Liveness holds as for dd_md_holds.
 */
int dd_md_find_holders(struct dd_metadata *md, u64 leaf, const u8 *fp,
		       u64 *pba, unsigned int max);
/* No holder found (dd_md_first_holders). */
#define DD_MD_NO_HOLDER		U64_MAX
/*
 * The first holder of each of @nr contents, in one hold of the metadata
 * lock (the known blocks of a write, looked up together): @at[i] names
 * the leaf of @fp[i] on the way in and the first live holder on the way
 * out, or DD_MD_NO_HOLDER when there is none, the search failed or
 * @fp[i] is NULL (nothing looked up). A content equal to the one looked
 * up before it, in the same leaf, shares its answer. The lock is let go
 * between searches now and then; like dd_md_find_holders()'s, the
 * answers are hints that a share checks again.
 */
void dd_md_first_holders(struct dd_metadata *md, u64 *at,
			 const u8 *const *fp, unsigned int nr);

/*
 * A free data block for new content. 0: *pba is allocated and *free_left is
 * the number of free data blocks left, those reserved for writers on other
 * CPUs included (dedup-reserve.h). -ENOSPC: none free. -EAGAIN: none free
 * now, but freed blocks come back at the next commit or the one after it
 * (see dedup-space.h). -EROFS when read-only.
 */
int dd_md_alloc_data(struct dd_metadata *md, u64 *pba, u64 *free_left);
/*
 * Up to @want consecutive free data blocks, at least one: [*first,
 * *first + *len). Errors as dd_md_alloc_data, and -EAGAIN too while the
 * free blocks are promised. With @promised, they are taken against
 * blocks dd_md_promise_data() promised, as many as *len.
 */
int dd_md_alloc_data_run(struct dd_metadata *md, u64 want, bool promised,
			 u64 *first, u64 *len, u64 *free_left);
/*
 * @n free data blocks promised to a write acknowledged before its blocks
 * are decided (early_ack), so that it never finds the device full after
 * its acknowledgment: false, and nothing promised, when fewer are free.
 * A block that stores its data takes its physical block against the
 * promise; one that does not gives it back with dd_md_promise_drop().
 * Other writers cannot take promised blocks: they wait (-EAGAIN) while
 * promises are out. Free blocks as reported include promised ones.
 */
bool dd_md_promise_data(struct dd_metadata *md, u64 n);
void dd_md_promise_drop(struct dd_metadata *md, u64 n);
void dd_md_free_data_now(struct dd_metadata *md, u64 pba);

/*
 * @pba, just written with new content, becomes @lba's block.
 * Returns 1 and fills *freed when @lba's previous block lost its last
 * reference, 0 when nothing was freed, < 0 on error.
 */
int dd_md_map_new(struct dd_metadata *md, u64 lba, u64 pba, const u8 *fp,
		  struct dd_md_freed *freed);

struct dd_md_new {
	u64 lba;
	u64 pba;
	const u8 *fp;
};

/*
 * dd_md_map_new for @nb[0..nr) in order, in one hold of the metadata lock
 * shared, but for each entry whose leaves the running transaction has
 * not written yet, which holds it exclusive for itself alone (as
 * dd_md_map_duplicates), up to and including the first entry that frees
 * a block or fails:
 * *done (>= 1) is the number of entries handled, and the result (and
 * *freed) is that of the last of them; the ones before it returned 0.
 */
int dd_md_map_new_run(struct dd_metadata *md, const struct dd_md_new *nb,
		      unsigned int nr, unsigned int *done,
		      struct dd_md_freed *freed);

/*
 * @lba shares the live block @pba: takes the reference and maps in one step.
 * 1/0 as dd_md_map_new. Soft misses, nothing changed (not even dirtying the
 * transaction): -ENOENT when @pba does not hold @fp's content any more (it
 * died; a later commit may have let it be reused), -EOVERFLOW when its
 * refcount is saturated. Liveness and content are checked in the same
 * step as the reference is taken, so whatever the caller looked up before
 * may be stale. No log line for either.
 */
int dd_md_map_duplicate(struct dd_metadata *md, u64 lba, u64 pba,
			const u8 *fp, struct dd_md_freed *freed);

struct dd_md_dup {
	u64 lba;
	u64 leaf;	/* the fingerprint leaf to find a live holder of fp in */
	const u8 *fp;
	/*
	 * 0, or PBA + 1 of the one holder to take: the block whose content
	 * the caller compared byte for byte (verify).
	 */
	u64 only;
	u64 pba;	/* out: the holder shared */
	int r;		/* what dd_md_map_duplicate would have returned */
};

/*
 * dd_md_map_duplicate for @d[0..nr) in order, in one hold of the metadata
 * lock shared, but for each entry whose leaves the running transaction
 * has not written yet, which holds it exclusive for itself alone; with
 * the first live holder of d[i].fp in fingerprint leaf d[i].leaf, or the
 * one d[i].only names if it is live and holds d[i].fp (-ENOENT: none),
 * up to and including the first entry that frees a block (its *freed) or
 * fails with an error other than a soft miss. *done (>= 1) is the number
 * of entries handled, each with its result in d[i].r. The entries map
 * distinct logical blocks (one write's).
 */
void dd_md_map_duplicates(struct dd_metadata *md, struct dd_md_dup *d,
			  unsigned int nr, unsigned int *done,
			  struct dd_md_freed *freed);

/* An all-zero block; 1/0 as dd_md_map_new. */
int dd_md_map_zero(struct dd_metadata *md, u64 lba, struct dd_md_freed *freed);

/*
 * Unmap logical blocks from @begin towards @end. Stops early once
 * @max_freed blocks were freed (max_freed >= 1), so a caller can drop them
 * from its index and call again from *next. *next is the first logical
 * block not yet processed (== @end when done); *nr_freed the entries filled
 * in @freed; *unmapped is INCREASED by the number of entries unmapped.
 */
int dd_md_unmap_range(struct dd_metadata *md, u64 begin, u64 end,
		      struct dd_md_freed *freed, unsigned int max_freed,
		      unsigned int *nr_freed, u64 *next, u64 *unmapped);

/*
 * The journal (format version 2, read-write): a flush appends the
 * changes since the last append instead of committing. Take them with
 * the transaction's changes kept out, then write them outside every
 * lock; one batch at a time, never across a commit. -ENODATA: nothing
 * to append; -ENOSPC: commit instead (no journal, no room in it, or
 * changes it could not keep); -EROFS.
 */
bool dd_md_journaled(struct dd_metadata *md);
int dd_md_journal_take(struct dd_metadata *md, struct dd_journal_batch *b);
int dd_md_journal_write(struct dd_metadata *md, struct dd_journal_batch *b);
/* A batch that must not be written after all (its data flush failed). */
void dd_md_journal_drop(struct dd_metadata *md, struct dd_journal_batch *b);
/*
 * The data flush that the last append went out beside succeeded: its
 * data need not be checked if this instance falls back after an abort.
 */
void dd_md_journal_data_stable(struct dd_metadata *md);
/*
 * Changes wait for an append (or a commit, if the journal dropped them),
 * or counts moved by changes that left no record.
 */
bool dd_md_journal_pending(struct dd_metadata *md);
/* Half the journal is used: a commit (its checkpoint) empties it. */
bool dd_md_checkpoint_due(struct dd_metadata *md);

/*
 * Before a commit, with changes still going on: write what the running
 * transaction changed so far, so that the commit, which keeps changes
 * out, writes only what changed since. A failed write fails the commit.
 */
void dd_md_write_ahead(struct dd_metadata *md);
/* @reusable may be NULL; it is not called for held frees. */
int dd_md_commit(struct dd_metadata *md, dd_reusable_fn reusable, void *ctx);
void dd_md_release_held(struct dd_metadata *md, dd_reusable_fn reusable,
			void *ctx);
void dd_md_abort(struct dd_metadata *md);
/*
 * At a clean close, after the last commit: write @saved and the
 * allocation state, named by a new superblock, so that the next open
 * loads them. Nothing may change afterwards (the metadata turns
 * read-only). -EBUSY when something is left to commit; on other errors
 * the device simply rebuilds at the next open.
 */
int dd_md_save(struct dd_metadata *md, const struct dd_md_saved *saved);
/*
 * Is a commit due? Also after a commit that freed data blocks: they are
 * reused only after one more commit (see dedup-space.h), which this
 * one asks for even when nothing else changed.
 */
bool dd_md_dirty(struct dd_metadata *md);
/*
 * Damage was found: roll back to the last commit and record the flag in
 * its superblock, so that every later open is read-only in needs_check
 * mode until the tools clear it. 1: the flag is on disk (now or already);
 * 0: not written (a read_only table never writes; at DD_MAX_TXN no
 * generation is left); < 0: the superblock write failed.
 */
int dd_md_flag_needs_check(struct dd_metadata *md);
/* The superblock carried DD_SB_NEEDS_CHECK when opened: read-only. */
bool dd_md_needs_check(struct dd_metadata *md);
int dd_md_writeback_error(struct dd_metadata *md);
void dd_md_stats(struct dd_metadata *md, struct dd_md_stats *st);
u64 dd_md_free_data_blocks(struct dd_metadata *md);
/* Data blocks freed in the running transaction. */
u64 dd_md_pending_data_frees(struct dd_metadata *md);
/* Data blocks that the next commit makes reusable (or held). */
u64 dd_md_data_reusable_at_commit(struct dd_metadata *md);

#endif
