/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * What the units of the target share: the per-device and per-bio state,
 * which unit owns each piece, and the locks.
 *
 * Lock order, outermost first (take a later one only while holding none
 * or some of the earlier ones, never the other way round):
 *
 *   dd_instances_lock  mutex    dm-dedup-target.c   construction, destruction
 *   dc->commit_mutex   mutex    dedup-commit.c      one commit at a time
 *   dc->lock           rwsem    dedup-commit.c      the transaction
 *   md->lock           rwsem    dedup-metadata.c    the metadata
 *   md->change_lock    mutex    dedup-metadata.c    changes in place under
 *                                                   md->lock held shared
 *   md->data_lock      mutex    dedup-metadata.c    the data allocator
 *   run->lock          spinlock dedup-reserve.c     one CPU's reserved data
 *                                                   blocks
 *   j->lock            mutex    dedup-journal.c     the journal's records and
 *                                                   ring position
 *   dc->index_lock     spinlock dedup-decide.c      the index, the in-flight
 *                                                   table
 *   dc->commit_lock    spinlock dedup-commit.c      flush and no-space waiters
 *   dc->flush_lock     spinlock dedup-commit.c      what the data flushes
 *                                                   covered, the one sent
 *                                                   ahead
 *   dc->cells.lock     spinlock dedup-cell.c        logical block cells
 *   bm->out_lock       spinlock dedup-block.c       the threads writing the
 *                                                   metadata out
 *
 * dc->lock is the transaction lock: every bio step that reads or changes
 * the metadata holds it shared, and a commit holds it exclusive, so the
 * transaction a commit writes holds only whole steps. md->lock,
 * md->change_lock and md->data_lock are taken inside each metadata verb
 * and never held across verbs; dm-bufio's client lock nests inside
 * md->lock, and bm->out_lock inside that (dm-bufio's write callback),
 * with no lock taken inside it. A CPU's run->lock is held only to take,
 * fill or drain its run, with no lock taken inside. dc->index_lock is
 * held for index and in-flight table operations only, never across I/O
 * or a metadata verb.
 * dc->cells.lock is innermost: it is taken with none of the spinlocks
 * held (a deferred read leaves its cell with dc->lock held shared), and
 * only queues work under it. dc->flush_lock is taken with commit_mutex
 * held or with none, also from a flush's completion. dc->commit_lock,
 * too, is taken from a completion: the last of an append's I/O
 * (dd_append_durable), with no other lock held. Each function that relies
 * on a lock asserts how it must be held.
 *
 * The units, top to bottom; a unit calls only the ones below it. A lower
 * unit that must decide a block of a write again (it waited for its twin
 * or for freed blocks) queues the block's own work, which dedup-io.c set
 * up, and never calls up. A unit may hand one below it a dd_io_group
 * (dedup-block.h), whose end it runs as a bio's end_io is run: when the
 * I/O is done, not as a call back into the unit's state.
 *
 *   dm-dedup-target.c  table lines, construction, status, messages,
 *                      suspend and resume
 *   dedup-io.c         the life of a bio: reads, the write front end
 *                      (copy, zero test, hash), unique data I/O, discards
 *   dedup-decide.c     the dedup decision: the index, the in-flight table,
 *                      verification (which reads the candidate block),
 *                      and every metadata change a bio makes
 *   dedup-commit.c     durability and modes: journal appends and commits,
 *                      flush, FUA and no-space waiters, aborts, the low
 *                      water mark
 */
#ifndef DM_DEDUP_TARGET_H
#define DM_DEDUP_TARGET_H

#include <linux/bio.h>
#include <linux/blk-cgroup.h>
#include <linux/device-mapper.h>
#include <linux/hashtable.h>
#include <linux/llist.h>
#include <linux/rwsem.h>
#include <linux/spinlock.h>
#include <linux/workqueue.h>

#include "dedup-cell.h"
#include "dedup-data.h"
#include "dedup-fingerprint.h"
#include "dedup-index.h"
#include "dedup-metadata.h"

#define DD_INFLIGHT_BITS	8
/* Blocks a discard frees between two updates of the index (on the stack). */
#define DD_FREED_BATCH		16

enum dd_mode {
	DD_MODE_RW,
	DD_MODE_RO,		/* read_only asked for, or a metadata I/O error */
	DD_MODE_NEEDS_CHECK,	/* metadata found damaged: run dedup check */
};

extern const char * const dd_mode_names[];

/* Batches of one-block writes in hand at once, at most (dedup-io.c). */
#define DD_HASH_WORKERS		8

struct dd_hash_worker {
	struct work_struct work;
	struct dedup_c *dc;
};

struct dedup_c {
	/* dm-dedup-target.c: set up by the constructor, then read-only */
	struct dm_target *ti;
	struct list_head instance;	/* on dd_instances */
	struct dm_dev *meta_dev;
	struct dm_dev *data_dev;
	struct dd_metadata *md;		/* under lock, see dedup-commit.c */
	struct dd_hasher hasher;
	struct dd_data_pool data_pool;
	struct bio_set bs;
	struct workqueue_struct *wq;
	/*
	 * read_work's alone: a commit that makes freed blocks reusable
	 * waits, with the transaction lock held exclusive, for the reads
	 * in flight, some of which only read_work sends. On dc->wq it could
	 * queue behind work items that wait for that lock, as many as the
	 * queue runs at once, and never run.
	 */
	struct workqueue_struct *read_wq;
	u64 logical_blocks;
	u64 data_blocks;
	unsigned int commit_interval;
	u64 low_water_mark;
	bool verify;
	bool discard_passdown;
	bool early_ack;		/* writes acknowledged once decided */
	bool read_only;		/* no metadata writes: see dedup_ctr() */
	bool read_only_opt;	/* the table line's read_only option */
	bool no_read_batching;	/* every read goes out from the map function */
	bool index_loaded;	/* at activation, from a clean close's save */
	u64 activation_ms;	/* opening the metadata and the index */

	/* dedup-commit.c */
	struct mutex commit_mutex;	/* a whole commit, and the six below */
	u64 flush_seq;		/* data flushes a commit started */
	u64 committed_seq;	/* ... and finished; under lock too */
	/* commits that let freed data blocks be reused; under lock too */
	u64 reuse_seq;
	u64 data_flushes_skipped;	/* of flush_seq, those not sent */
	/* how long commits held writers out, in total and at most at once */
	u64 commit_hold_ns;
	u64 commit_hold_max_ns;
	struct rw_semaphore lock;	/* the transaction, see above */
	u64 appends_taken;		/* under lock held exclusive */
	int mode;			/* only raised, by cmpxchg; read anywhere */
	atomic_t low_water_raised;	/* set by a writer, cleared by commit */
	atomic_t checkpoint_wanted;	/* the commit interval passed */
	atomic64_t data_writes_done;	/* counted as each completes */
	struct workqueue_struct *commit_wq;
	struct work_struct commit_work;
	struct delayed_work periodic_commit;
	struct work_struct abort_work;	/* for errors found under a shared lock */
	spinlock_t commit_lock;		/* protects the five below */
	struct bio_list commit_waiters;	/* flushes and FUA writes */
	struct list_head nospc_waiters;	/* writes waiting for freed blocks */
	/*
	 * The append on its way (number joined_append), and the flush
	 * requests that came meanwhile and need nothing more: every change
	 * acknowledged before them is in it (dd_flush_request)
	 */
	bool join_open;
	u64 joined_append;
	struct bio_list joined;
	/* The newest append a completed write or discard needs: dd_change_acked */
	atomic64_t acked_append;
	atomic64_t appends_joined;	/* flush requests that joined one */
	struct list_head flush_waiters;	/* new data written during a flush */
	/* Reads that may still touch a block freed in this transaction. */
	atomic_t reads_inflight;
	wait_queue_head_t reads_wait;
	atomic64_t discard_passdown_blocks;
	/*
	 * What the data flushes covered, and the one sent before a flush
	 * request needs it (dd_flush_ahead)
	 */
	spinlock_t flush_lock;		/* protects the eight below */
	/* the newest data_writes_done a flush that succeeded was sent at */
	u64 data_writes_flushed;
	bool ahead_armed;		/* by the last flush request */
	bool append_armed;		/* ... for an append too */
	unsigned int ahead_idles;	/* dd_writes_idle() since that request */
	bool ahead_inflight;		/* ahead_bio is on its way */
	u64 ahead_count;		/* data_writes_done when it was sent */
	u64 ahead_sent;			/* how many were sent: names each */
	int ahead_error;		/* one sent ahead failed: never cleared */
	struct bio ahead_bio;
	struct dd_io_group *ahead_group;	/* an append's, put at its end */
	wait_queue_head_t ahead_wait;	/* ahead_inflight went false */
	atomic64_t data_flushes_ahead;
	atomic64_t appends_ahead;	/* appends dd_writes_idle() began */

	/* dedup-decide.c (the stats message reads the index's counts racily) */
	spinlock_t index_lock;		/* protects the three below */
	struct dd_index index;
	DECLARE_HASHTABLE(inflight, DD_INFLIGHT_BITS);	/* unique writes */
	/* leaders that left the in-flight table, per fingerprint bucket */
	u32 inflight_ends[1 << DD_INFLIGHT_BITS];
	atomic64_t verify_mismatches;
	atomic64_t verify_reads;	/* data reads verify made */
	atomic64_t index_full;
	/* leaves the index offered, and those that held no live holder */
	atomic64_t index_candidates;
	atomic64_t index_false_candidates;
	u64 index_loads;	/* activations that loaded it since a walk */
	atomic64_t nospc_errors;

	/* dedup-io.c */
	struct dd_cells cells;		/* writes and discards in flight */
	struct llist_head to_hash;	/* one-block writes waiting for their hash */
	/* hash and decide them a batch each */
	struct dd_hash_worker hash_work[DD_HASH_WORKERS];
	unsigned long hash_busy;	/* a bit per worker: queued or running */
	struct llist_head to_write;	/* runs waiting for their data bio */
	struct work_struct write_work;	/* submits them, a batch at a time */
	struct llist_head stored;	/* runs whose data write completed */
	struct work_struct stored_work;	/* maps them, a batch at a time */
	struct llist_head to_read;	/* remapped reads waiting to go out */
	struct work_struct read_work;	/* submits them, a batch at a time */
	bool read_batching;		/* reads go out in batches */
	unsigned int read_batch_avg;	/* reads per batch; read_work's own */
	mempool_t write_pool;		/* struct dd_write */
	mempool_t batch_pool;		/* block arrays of multi-block writes */
	atomic_t writes_inflight;	/* from their map to their end */
	atomic64_t data_write_errors;
	atomic64_t deferred_reads;
	atomic64_t read_batches;	/* submissions of dc->to_read */
	atomic64_t batched_reads;	/* reads they submitted */
	/* writes acknowledged before they are done (early_ack) */
	spinlock_t ack_lock;		/* protects the three below */
	unsigned int acked_blocks;	/* their blocks; read without the lock */
	struct bio_list acked_flushes;	/* flushes waiting for them */
	int acked_error;		/* the first that failed since a flush */
	wait_queue_head_t acked_wait;	/* acked_blocks went to 0 */
	atomic64_t early_acks;
	atomic64_t early_acks_undecided;	/* of them, before their decision */
};

/* Blocks a write or read bio carries at most (dm core splits the rest). */
#define DD_BIO_BLOCKS		64

enum dd_block_flags {
	DD_BLOCK_ZERO = 1 << 0,
	/* a data block is promised to it until it is decided (early_ack) */
	DD_BLOCK_PROMISED = 1 << 1,
};

enum dd_decision {
	DD_DONE,	/* mapped (duplicate or zero), or failed: see error */
	DD_STORE,	/* pba is ours: write the data, then dd_decide_stored() */
	DD_PARKED,	/* its work runs again later: behind its twin, or for
			 * freed blocks
			 */
};

/*
 * One 4 KiB block of a write, as dedup-decide.c decides it. The blocks of
 * one bio are decided together, but each may be parked and decided again
 * on its own.
 */
struct dd_write_block {
	struct dd_write *w;
	struct work_struct work;	/* hashing, a data write's end, a retry */
	u64 lba;
	u64 pba;
	struct page *data;		/* our copy of the block */
	u8 fp[DD_FP_SIZE];
	unsigned int flags;
	int error;			/* what became of it, once DD_DONE */
	u64 flush_ticket;		/* its run written without error: dd_flush_ticket */
	struct hlist_node inflight_node;	/* under dc->index_lock */
	struct list_head waiters;	/* same content, waiting for us */
	struct list_head wait_entry;	/* on a leader's waiters, or no-space */
	/*
	 * Under verify, PBA + 1 of the leader that woke us, found equal to
	 * our data in memory; good while dc->reuse_seq is twin_seq.
	 */
	u64 twin;
	u64 twin_seq;
	struct dd_write_block *run_next;	/* next block in the same data bio */
	/* a run's first block: on dc->to_write, then on dc->stored */
	struct llist_node run_node;
};

/* Runs, and their blocks, that dd_decide_stored_runs() maps at once. */
#define DD_STORED_RUNS		16
#define DD_STORED_BLOCKS	(2 * DD_BIO_BLOCKS)

static inline unsigned int dd_run_len(const struct dd_write_block *run)
{
	unsigned int n = 0;

	for (; run; run = run->run_next)
		n++;
	return n;
}

/*
 * A write bio cut into blocks (dedup-io.c), from dc->write_pool: it lives
 * from the bio's map until its last block is done, outside the bio's
 * per-bio data.
 */
struct dd_write {
	struct dedup_c *dc;
	struct bio *bio;		/* NULL once acknowledged early */
	blk_opf_t hints;		/* what its data bios keep of its flags */
	unsigned short ioprio;
	struct cgroup_subsys_state *css;	/* its cgroup once acknowledged */
	struct work_struct work;	/* its decision, after waiting its turn */
	struct llist_node hash_node;	/* a one-block write on dc->to_hash */
	struct list_head ready;		/* in its hash batch: its turn came */
	bool ack_decided;		/* early_ack: try again once decided */
	struct dd_cell cell;		/* its turn: see dedup-cell.h */
	struct dd_write_block *blk;		/* nr of them: one inline, or a batch */
	unsigned int nr;
	atomic_t hashing;		/* chunks still being hashed (dd_hash_work) */
	atomic_t pending;		/* blocks not yet done */
	int error;			/* the first block's error that failed */
	atomic64_t append;		/* the append its changes go with */
	bool fua;			/* durable when it completes */
	bool pooled;			/* blk came from dc->batch_pool */
	struct dd_write_block one;	/* a one-block write needs no batch */
	struct page *one_page;
};

/*
 * Whom the data bios made for @w are for (dd_data_own): its bio's cgroup,
 * which the write took when it reached the target, or the one kept when
 * it was acknowledged early. Asked while the write is in flight, when
 * its bio cannot complete.
 */
static inline void dd_write_owner(const struct dd_write *w,
				  struct dd_data_owner *o)
{
	o->css = w->bio ? bio_blkcg_css(w->bio) : w->css;
	o->ioprio = w->ioprio;
}

/* Per block of a batch: the block, then (after all blocks) its page. */
#define DD_BATCH_BYTES	(sizeof(struct dd_write_block) + sizeof(struct page *))

enum dd_io_flags {
	DD_IO_READ_TRACKED = 1 << 0,
	DD_IO_READ_BEHIND = 1 << 1,	/* waited in a cell for a write */
};

/* Per-bio state, in the space dm reserves for the target. */
struct dd_io {
	struct dedup_c *dc;
	struct work_struct work;	/* a read's or a discard's */
	struct llist_node read_node;	/* a read in dc->to_read */
	u64 lba;
	unsigned int flags;
	struct dd_cell cell;		/* a discard's turn, or a read's */
};

/* Raise @v to @n, if below: several CPUs may raise it at once. */
static inline void dd_raise(atomic64_t *v, u64 n)
{
	s64 old = atomic64_read(v);

	while (old < (s64)n && !atomic64_try_cmpxchg(v, &old, n))
		;
}

static inline struct bio *dd_bio(struct dd_io *io)
{
	return dm_bio_from_per_bio_data(io, sizeof(*io));
}

static inline const char *dd_name(struct dedup_c *dc)
{
	return dm_table_device_name(dc->ti->table);
}

static inline void dd_endio(struct bio *bio, blk_status_t status)
{
	bio->bi_status = status;
	bio_endio(bio);
}

/* dedup-io.c */
void dd_io_init(struct dedup_c *dc);
int dd_io_map(struct dedup_c *dc, struct bio *bio);
void dd_io_end(struct dedup_c *dc, struct bio *bio);
void dd_io_drain(struct dedup_c *dc);

/* dedup-decide.c */
void dd_decide_init(struct dedup_c *dc);
int dd_index_visit(void *ctx, u64 pba, const u8 *fp);
void dd_index_saved_view(struct dedup_c *dc, struct dd_md_saved *s);
int dd_index_saved_ok(void *ctx, const struct dd_md_saved *s,
		      const struct dd_space *live, const char **why);
extern const char dd_index_walk_due[];
void dd_index_saved_adopt(struct dedup_c *dc, const struct dd_md_saved *s);
bool dd_decide_promise(struct dedup_c *dc, struct dd_write_block *blk,
		       unsigned int nr);
void dd_decide_write(struct dedup_c *dc, struct dd_write_block *blk,
		     unsigned int nr, u8 *decision);
unsigned int dd_decide_stored_runs(struct dedup_c *dc,
				   struct dd_write_block **runs,
				   unsigned int nr);
bool dd_decide_stored(struct dedup_c *dc, struct dd_write_block *run, int error);
int dd_decide_unmap(struct dedup_c *dc, u64 begin, u64 end, u64 *append);

/* dedup-commit.c */
void dd_commit_init(struct dedup_c *dc);
void dd_commit_start(struct dedup_c *dc);
void dd_commit_stop(struct dedup_c *dc);
int dd_commit(struct dedup_c *dc);
int dd_commit_settled(struct dedup_c *dc);
void dd_defer_to_commit(struct dedup_c *dc, struct bio *bio);
void dd_flush_request(struct dedup_c *dc, struct bio *bio);
u64 dd_change_append(struct dedup_c *dc);
void dd_change_acked(struct dedup_c *dc, u64 append);
void dd_wait_for_frees(struct dedup_c *dc, struct dd_write_block *blk);
u64 dd_flush_ticket(struct dedup_c *dc);
void dd_fua_data_written(struct dedup_c *dc);
void dd_writes_idle(struct dedup_c *dc);
int dd_journal_data_verify(void *ctx, u64 pba, const u8 *fp);
int dd_journal_data_flush(void *ctx);
bool dd_data_covered(struct dedup_c *dc, struct dd_write_block *run);
void dd_degrade(struct dedup_c *dc, int mode, const char *what, int r);
void dd_metadata_error(struct dedup_c *dc, const char *what, int r);
void dd_metadata_error_shared(struct dedup_c *dc, const char *what, int r);
void dd_check_writeback(struct dedup_c *dc);
void dd_let_commit_in(struct dedup_c *dc);
void dd_low_water_check(struct dedup_c *dc, u64 free);
void dd_read_track(struct dedup_c *dc, struct dd_io *io);
void dd_read_untrack(struct dedup_c *dc, struct dd_io *io);
unsigned int dd_reads_in_flight(struct dedup_c *dc);

#endif
