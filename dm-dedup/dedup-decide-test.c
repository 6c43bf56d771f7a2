// SPDX-License-Identifier: GPL-2.0-only
/*
 * KUnit tests of the dedup decision (dedup-decide.c) on its own: a device
 * state with real metadata on the test ram disk and a real index, and
 * writes whose data never goes anywhere. A block the decision hands a
 * physical block (DD_STORE) is declared written at once with
 * dd_decide_stored(), as dedup-io.c does when the data write completes.
 */
#include <kunit/test.h>
#include <linux/workqueue.h>

#include "dedup-target.h"
#include "dedup-test-util.h"

/* A one-block write as the decision sees it, and what became of it. */
struct dd_test_write {
	struct dd_write w;
	struct dd_write_block b;
	atomic_t *done;
	int r;
};

static void dd_test_dc_put(void *p)
{
	struct dedup_c *dc = p;

	destroy_workqueue(dc->wq);
	dd_index_exit(&dc->index);
}

/* A device state as the constructor leaves it, without a table or bios. */
static struct dedup_c *dd_test_dc(struct kunit *test, u64 logical, u64 data)
{
	struct block_device *bdev = dd_test_dev_open(test);
	struct dedup_c *dc = kunit_kzalloc(test, sizeof(*dc), GFP_KERNEL);
	struct dd_md_config cfg;

	KUNIT_ASSERT_NOT_NULL(test, dc);
	dd_commit_init(dc);
	dd_decide_init(dc);
	KUNIT_ASSERT_EQ(test, dd_index_init(&dc->index, data), 0);
	dc->wq = alloc_workqueue("dd-decide-test", WQ_UNBOUND, 0);
	if (!dc->wq)
		dd_index_exit(&dc->index);
	KUNIT_ASSERT_NOT_NULL(test, dc->wq);
	KUNIT_ASSERT_EQ(test, kunit_add_action_or_reset(test, dd_test_dc_put, dc),
			0);
	dd_test_md_config(&cfg, logical, data);
	cfg.visit = dd_index_visit;
	cfg.ctx = dc;
	dc->md = dd_test_md_open(test, bdev, &cfg);
	dc->logical_blocks = logical;
	dc->data_blocks = data;
	return dc;
}

static void dd_test_requeued(struct work_struct *w)
{
	struct dd_test_write *tw = container_of(w, struct dd_test_write,
						b.work);

	atomic_inc(tw->done);
}

/* Block @b of write @w, hashed: content @seed (0: a zero block) at @lba. */
static void dd_test_block(struct dd_write *w, struct dd_write_block *b,
			  struct dedup_c *dc, u64 lba, u64 seed)
{
	w->dc = dc;
	b->w = w;
	b->lba = lba;
	b->flags = 0;
	if (seed)
		dd_test_fp(b->fp, seed);
	else
		b->flags |= DD_BLOCK_ZERO;
	INIT_LIST_HEAD(&b->wait_entry);
	INIT_WORK(&b->work, dd_test_requeued);
}

/* @nr blocks of one write *@w, for dd_test_block() to fill in. */
static struct dd_write_block *dd_test_blocks(struct kunit *test,
					     unsigned int nr,
					     struct dd_write **w)
{
	struct dd_write_block *blk = kunit_kcalloc(test, nr, sizeof(*blk),
						   GFP_KERNEL);

	*w = kunit_kzalloc(test, sizeof(**w), GFP_KERNEL);
	KUNIT_ASSERT_NOT_NULL(test, *w);
	KUNIT_ASSERT_NOT_NULL(test, blk);
	return blk;
}

/* A hashed write of content @seed (0: a zero block) to @lba. */
static struct dd_test_write *dd_test_new_write(struct kunit *test,
					       struct dedup_c *dc, u64 lba,
					       u64 seed, atomic_t *done)
{
	struct dd_test_write *tw = kunit_kzalloc(test, sizeof(*tw), GFP_KERNEL);

	KUNIT_ASSERT_NOT_NULL(test, tw);
	dd_test_block(&tw->w, &tw->b, dc, lba, seed);
	tw->done = done;
	return tw;
}

/* One decision, with what became of the block in tw->r once DD_DONE. */
static enum dd_decision dd_test_decide_only(struct dedup_c *dc,
					    struct dd_test_write *tw)
{
	u8 d;

	dd_decide_write(dc, &tw->b, 1, &d);
	tw->r = tw->b.error;
	return d;
}

/* Decide, and complete a DD_STORE block as its data write would. */
static enum dd_decision dd_test_decide(struct dedup_c *dc,
				       struct dd_test_write *tw)
{
	enum dd_decision d = dd_test_decide_only(dc, tw);

	if (d == DD_STORE) {
		tw->b.run_next = NULL;
		dd_decide_stored(dc, &tw->b, 0);
		tw->r = tw->b.error;
	}
	return d;
}

static struct dd_md_stats dd_test_dc_stats(struct dedup_c *dc)
{
	struct dd_md_stats st;

	dd_md_stats(dc->md, &st);
	return st;
}

static u64 dd_test_map_of(struct kunit *test, struct dedup_c *dc, u64 lba)
{
	u64 pba = U64_MAX;

	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, lba, &pba, false), 0);
	return pba;
}

static void dd_decide_test_store_then_share(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	struct dd_test_write *a = dd_test_new_write(test, dc, 0, 1, NULL);
	struct dd_test_write *b = dd_test_new_write(test, dc, 9, 1, NULL);
	struct dd_test_write *z = dd_test_new_write(test, dc, 9, 0, NULL);
	struct dd_md_stats st;

	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, a), DD_STORE);
	KUNIT_EXPECT_EQ(test, a->r, 0);
	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, b), DD_DONE);
	KUNIT_EXPECT_EQ(test, b->r, 0);
	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 9), a->b.pba);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.data_live, 1);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 1);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 1);

	/* A zero write unmaps; the shared block keeps its other sharer. */
	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, z), DD_DONE);
	KUNIT_EXPECT_EQ(test, z->r, 0);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.mapped, 1);
	KUNIT_EXPECT_EQ(test, st.data_live, 1);
}

/*
 * The same new content while its first copy is on its way: the second
 * write waits and is run again when the first is mapped, then shares it.
 * Other content does not wait.
 */
static void dd_decide_test_follower(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	atomic_t requeued = ATOMIC_INIT(0);
	struct dd_test_write *lead = dd_test_new_write(test, dc, 0, 7, &requeued);
	struct dd_test_write *twin = dd_test_new_write(test, dc, 1, 7, &requeued);
	struct dd_test_write *other = dd_test_new_write(test, dc, 2, 8, &requeued);

	KUNIT_ASSERT_EQ(test, dd_test_decide_only(dc, lead), DD_STORE);
	KUNIT_EXPECT_EQ(test, dd_test_decide_only(dc, twin), DD_PARKED);
	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, other), DD_STORE);
	flush_workqueue(dc->wq);
	KUNIT_EXPECT_EQ(test, atomic_read(&requeued), 0);

	lead->b.run_next = NULL;
	dd_decide_stored(dc, &lead->b, 0);
	KUNIT_EXPECT_EQ(test, lead->b.error, 0);
	flush_workqueue(dc->wq);
	KUNIT_EXPECT_EQ(test, atomic_read(&requeued), 1);
	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, twin), DD_DONE);
	KUNIT_EXPECT_EQ(test, twin->r, 0);
	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 1), lead->b.pba);
	KUNIT_EXPECT_EQ(test, dd_test_dc_stats(dc).data_live, 2);
}

/*
 * The index still names a block whose last reference went (a step of
 * another write freed it between our index lookup and our share): the
 * share is a soft miss and the write stores a copy of its own, never
 * sharing the dead block and never calling it corruption.
 */
static void dd_decide_test_candidate_died(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	struct dd_test_write *a = dd_test_new_write(test, dc, 0, 3, NULL);
	struct dd_test_write *b = dd_test_new_write(test, dc, 1, 3, NULL);
	struct dd_md_freed freed;
	struct dd_md_stats st;

	KUNIT_ASSERT_EQ(test, dd_test_decide(dc, a), DD_STORE);
	KUNIT_ASSERT_EQ(test, a->r, 0);
	/* The metadata step alone, as if the index update had not run yet. */
	KUNIT_ASSERT_EQ(test, dd_md_map_zero(dc->md, 0, &freed), 1);
	KUNIT_EXPECT_EQ(test, freed.pba, a->b.pba);

	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, b), DD_STORE);
	KUNIT_EXPECT_EQ(test, b->r, 0);
	KUNIT_EXPECT_NE(test, b->b.pba, a->b.pba);
	KUNIT_EXPECT_EQ(test, READ_ONCE(dc->mode), DD_MODE_RW);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.data_live, 1);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 0);
}

/*
 * Worse: the index still names a block that was freed, committed and
 * reused for other content. Its record now holds that content, and the
 * share checks record and liveness in one step: never shared.
 */
static void dd_decide_test_candidate_reused(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 1);
	struct dd_test_write *a = dd_test_new_write(test, dc, 0, 3, NULL);
	struct dd_test_write *x = dd_test_new_write(test, dc, 1, 4, NULL);
	struct dd_test_write *a2 = dd_test_new_write(test, dc, 2, 3, NULL);
	struct dd_md_freed freed;
	u64 pba;

	KUNIT_ASSERT_EQ(test, dd_test_decide(dc, a), DD_STORE);
	KUNIT_ASSERT_EQ(test, a->r, 0);
	KUNIT_ASSERT_EQ(test, dd_md_map_zero(dc->md, 0, &freed), 1);
	/* The second commit makes the block reusable (dedup-space.h). */
	KUNIT_ASSERT_EQ(test, dd_md_commit(dc->md, NULL, NULL), 0);
	KUNIT_ASSERT_EQ(test, dd_md_commit(dc->md, NULL, NULL), 0);
	KUNIT_ASSERT_EQ(test, dd_test_decide(dc, x), DD_STORE);
	KUNIT_ASSERT_EQ(test, x->b.pba, a->b.pba);	/* the only block */

	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, a2), DD_DONE);
	KUNIT_EXPECT_EQ(test, a2->r, -ENOSPC);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 2, &pba, false), -ENODATA);
	KUNIT_EXPECT_EQ(test, dd_test_dc_stats(dc).duplicate_writes, 0);
}

/*
 * No block left: the write fails with ENOSPC and leaves the in-flight
 * table, so the next write of the same content fails too instead of
 * waiting forever behind it.
 */
static void dd_decide_test_full(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 2);
	struct dd_test_write *w[4];
	int i;

	for (i = 0; i < 4; i++)
		w[i] = dd_test_new_write(test, dc, i, i < 2 ? i + 1 : 5, NULL);
	for (i = 0; i < 2; i++) {
		KUNIT_EXPECT_EQ(test, dd_test_decide(dc, w[i]), DD_STORE);
		KUNIT_EXPECT_EQ(test, w[i]->r, 0);
	}
	for (i = 2; i < 4; i++) {
		KUNIT_EXPECT_EQ(test, dd_test_decide(dc, w[i]), DD_DONE);
		KUNIT_EXPECT_EQ(test, w[i]->r, -ENOSPC);
	}
	KUNIT_EXPECT_EQ(test, atomic64_read(&dc->nospc_errors), 2);
}

/*
 * The blocks of one write decided in one pass: the zero block mapped, a
 * content repeated inside the write parked behind its first copy, and the
 * new contents given consecutive physical blocks, so their data can go
 * out as one bio. Once that run is stored, the parked blocks share it.
 */
struct dd_test_batch {
	struct dd_write w;
	struct dd_write_block blk[8];
	atomic_t requeued;
};

static void dd_test_batch_requeued(struct work_struct *work)
{
	struct dd_write_block *b = container_of(work, struct dd_write_block, work);

	atomic_inc(&container_of(b->w, struct dd_test_batch, w)->requeued);
}

static void dd_decide_test_batch(struct kunit *test)
{
	static const u64 content[8] = { 1, 2, 1, 0, 3, 2, 4, 4 };
	static const u8 want[8] = { DD_STORE, DD_STORE, DD_PARKED, DD_DONE,
				    DD_STORE, DD_PARKED, DD_STORE, DD_PARKED };
	static const unsigned int stored[4] = { 0, 1, 4, 6 };
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	struct dd_test_batch *t = kunit_kzalloc(test, sizeof(*t), GFP_KERNEL);
	struct dd_test_write *tw;
	struct dd_write_block *blk;
	struct dd_md_stats st;
	u8 d[8];
	int i;

	KUNIT_ASSERT_NOT_NULL(test, t);
	blk = t->blk;
	for (i = 0; i < 8; i++) {
		dd_test_block(&t->w, &blk[i], dc, 16 + i, content[i]);
		INIT_WORK(&blk[i].work, dd_test_batch_requeued);
	}
	dd_decide_write(dc, blk, 8, d);
	for (i = 0; i < 8; i++)
		KUNIT_EXPECT_EQ_MSG(test, d[i], want[i], "block %d", i);
	KUNIT_EXPECT_EQ(test, blk[3].error, 0);
	for (i = 0; i < 4; i++) {
		KUNIT_EXPECT_EQ_MSG(test, blk[stored[i]].pba, blk[0].pba + i,
				    "block %u", stored[i]);
		blk[stored[i]].run_next = i < 3 ? &blk[stored[i + 1]] : NULL;
	}

	dd_decide_stored(dc, &blk[0], 0);
	for (i = 0; i < 4; i++)
		KUNIT_EXPECT_EQ(test, blk[stored[i]].error, 0);
	flush_workqueue(dc->wq);
	KUNIT_EXPECT_EQ(test, atomic_read(&t->requeued), 3);

	/* Decided again, each parked block shares its first copy. */
	for (i = 0; i < 8; i++) {
		if (d[i] != DD_PARKED)
			continue;
		tw = dd_test_new_write(test, dc, 16 + i, content[i], NULL);
		KUNIT_EXPECT_EQ(test, dd_test_decide(dc, tw), DD_DONE);
		KUNIT_EXPECT_EQ(test, tw->r, 0);
	}
	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 18), blk[0].pba);
	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 21), blk[1].pba);
	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 23), blk[6].pba);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 4);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 3);
	KUNIT_EXPECT_EQ(test, st.zero_writes, 1);
	KUNIT_EXPECT_EQ(test, st.data_live, 4);
	KUNIT_EXPECT_EQ(test, st.mapped, 7);
}

/*
 * A write of 40 blocks whose content is stored already, over logical
 * blocks of which some mapped the stored block and some another: all
 * shared, in groups, and the other block freed by the overwrite.
 */
static void dd_decide_test_batch_of_duplicates(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	struct dd_test_write *a = dd_test_new_write(test, dc, 0, 5, NULL);
	struct dd_test_write *x = dd_test_new_write(test, dc, 20, 6, NULL);
	struct dd_write_block *blk;
	struct dd_md_stats st;
	struct dd_write *w;
	u8 d[40];
	int i;

	KUNIT_ASSERT_EQ(test, dd_test_decide(dc, a), DD_STORE);
	KUNIT_ASSERT_EQ(test, dd_test_decide(dc, x), DD_STORE);
	blk = dd_test_blocks(test, 40, &w);
	for (i = 0; i < 40; i++)
		dd_test_block(w, &blk[i], dc, i, 5);
	dd_decide_write(dc, blk, 40, d);
	for (i = 0; i < 40; i++) {
		KUNIT_EXPECT_EQ_MSG(test, d[i], DD_DONE, "block %d", i);
		KUNIT_EXPECT_EQ_MSG(test, blk[i].error, 0, "block %d", i);
		KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, i), a->b.pba);
	}
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 40);
	KUNIT_EXPECT_EQ(test, st.data_live, 1);
	KUNIT_EXPECT_EQ(test, st.pending_free, 1);
	KUNIT_EXPECT_EQ(test, st.mapped, 40);
}

/*
 * A write whose first block takes the content its second block replaces:
 * the share comes first, so the replaced block keeps a reference and is
 * never freed, and both blocks read what was written.
 */
static void dd_decide_test_batch_shares_what_it_replaces(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	struct dd_test_write *old = dd_test_new_write(test, dc, 1, 8, NULL);
	struct dd_write_block *blk;
	struct dd_md_stats st;
	struct dd_write *w;
	u8 d[2];

	KUNIT_ASSERT_EQ(test, dd_test_decide(dc, old), DD_STORE);
	blk = dd_test_blocks(test, 2, &w);
	dd_test_block(w, &blk[0], dc, 0, 8);	/* what lba 1 holds now */
	dd_test_block(w, &blk[1], dc, 1, 9);	/* lba 1 gets new content */
	dd_decide_write(dc, blk, 2, d);
	KUNIT_EXPECT_EQ(test, d[0], DD_DONE);
	KUNIT_EXPECT_EQ(test, blk[0].error, 0);
	KUNIT_ASSERT_EQ(test, d[1], DD_STORE);
	blk[1].run_next = NULL;
	dd_decide_stored(dc, &blk[1], 0);
	KUNIT_EXPECT_EQ(test, blk[1].error, 0);

	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 0), old->b.pba);
	KUNIT_EXPECT_EQ(test, dd_test_map_of(test, dc, 1), blk[1].pba);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.pending_free, 0);
	KUNIT_EXPECT_EQ(test, st.data_live, 2);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, 1);
}

/* Many writers at once: run the decision, and again whenever requeued. */
static void dd_test_decide_work(struct work_struct *w)
{
	struct dd_test_write *tw = container_of(w, struct dd_test_write,
						b.work);

	if (dd_test_decide(tw->w.dc, tw) != DD_PARKED)
		atomic_inc(tw->done);
}

/*
 * Writes of two contents to 32 logical blocks, all queued at once on an
 * unbound workqueue: each content is stored exactly once and every block
 * maps the copy of its own content.
 */
static void dd_decide_test_concurrent_writers(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 32);
	atomic_t done = ATOMIC_INIT(0);
	struct dd_test_write *w[32];
	struct dd_md_stats st;
	u64 pba[2] = { U64_MAX, U64_MAX };
	int i, n;

	for (i = 0; i < ARRAY_SIZE(w); i++) {
		w[i] = dd_test_new_write(test, dc, i, 11 + i % 2, &done);
		INIT_WORK(&w[i]->b.work, dd_test_decide_work);
	}
	for (i = 0; i < ARRAY_SIZE(w); i++)
		queue_work(dc->wq, &w[i]->b.work);
	/* Requeued followers are queued after a flush began: flush again. */
	for (n = 0; n < 100 && atomic_read(&done) < ARRAY_SIZE(w); n++)
		flush_workqueue(dc->wq);
	KUNIT_ASSERT_EQ(test, atomic_read(&done), ARRAY_SIZE(w));

	for (i = 0; i < ARRAY_SIZE(w); i++) {
		u64 p = dd_test_map_of(test, dc, i);

		KUNIT_EXPECT_EQ(test, w[i]->r, 0);
		if (pba[i % 2] == U64_MAX)
			pba[i % 2] = p;
		KUNIT_EXPECT_EQ(test, p, pba[i % 2]);
	}
	KUNIT_EXPECT_NE(test, pba[0], pba[1]);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.data_live, 2);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 2);
	KUNIT_EXPECT_EQ(test, st.duplicate_writes, ARRAY_SIZE(w) - 2);
	KUNIT_EXPECT_EQ(test, st.mapped, ARRAY_SIZE(w));
}

/*
 * New data whose write completed after a commit began flushing the data
 * device is not mapped until that commit is done: the commit would point
 * at data its flush may not cover.
 */
static void dd_decide_test_stored_waits_for_flushing_commit(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 64);
	atomic_t done = ATOMIC_INIT(0);
	struct dd_test_write *tw = dd_test_new_write(test, dc, 3, 7, &done);
	u64 pba;

	KUNIT_ASSERT_EQ(test, dd_test_decide_only(dc, tw), DD_STORE);
	tw->b.run_next = NULL;
	dc->flush_seq = 1;		/* a commit's data flush began */
	tw->b.flush_ticket = dd_flush_ticket(dc);
	KUNIT_EXPECT_FALSE(test, dd_decide_stored(dc, &tw->b, 0));
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 3, &pba, false), -ENODATA);
	KUNIT_EXPECT_PTR_EQ(test, dc->flush_waiters.next, &tw->b.wait_entry);

	dc->committed_seq = 1;		/* it is done and queues the run */
	list_del_init(&tw->b.wait_entry);
	KUNIT_EXPECT_TRUE(test, dd_decide_stored(dc, &tw->b, 0));
	KUNIT_EXPECT_EQ(test, tw->b.error, 0);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 3, &pba, false), 0);
	KUNIT_EXPECT_EQ(test, pba, tw->b.pba);

	/* Completed before the next flush began: mapped at once. */
	tw = dd_test_new_write(test, dc, 4, 8, &done);
	KUNIT_ASSERT_EQ(test, dd_test_decide_only(dc, tw), DD_STORE);
	tw->b.run_next = NULL;
	tw->b.flush_ticket = dd_flush_ticket(dc);
	KUNIT_EXPECT_TRUE(test, dd_decide_stored(dc, &tw->b, 0));
	KUNIT_EXPECT_TRUE(test, list_empty(&dc->flush_waiters));
}

/*
 * Runs whose data writes completed together are decided in one call: a
 * covered run is mapped, one that completed during a commit's data flush
 * waits for it, and a failed one gives its block back without entering
 * the index or the map. The runs done come first, in order.
 */
static void dd_decide_test_stored_runs(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 64);
	atomic_t done = ATOMIC_INIT(0);
	struct dd_test_write *tw[3], *again;
	struct dd_write_block *runs[3];
	struct dd_md_stats st;
	u64 pba;
	int i;

	for (i = 0; i < 3; i++) {
		tw[i] = dd_test_new_write(test, dc, 10 + i, 21 + i, &done);
		KUNIT_ASSERT_EQ(test, dd_test_decide_only(dc, tw[i]), DD_STORE);
		tw[i]->b.run_next = NULL;
		tw[i]->b.flush_ticket = dd_flush_ticket(dc);
		runs[i] = &tw[i]->b;
	}
	dc->flush_seq = 1;		/* a commit's data flush began ... */
	tw[1]->b.flush_ticket = dd_flush_ticket(dc);	/* ... before this */
	tw[2]->b.error = -EIO;		/* and this data write failed */

	KUNIT_EXPECT_EQ(test, dd_decide_stored_runs(dc, runs, 3), 2);
	KUNIT_EXPECT_PTR_EQ(test, runs[0], &tw[0]->b);
	KUNIT_EXPECT_PTR_EQ(test, runs[1], &tw[2]->b);
	KUNIT_EXPECT_EQ(test, tw[0]->b.error, 0);
	KUNIT_EXPECT_EQ(test, tw[2]->b.error, -EIO);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 10, &pba, false), 0);
	KUNIT_EXPECT_EQ(test, pba, tw[0]->b.pba);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 11, &pba, false), -ENODATA);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 12, &pba, false), -ENODATA);
	KUNIT_EXPECT_PTR_EQ(test, dc->flush_waiters.next, &tw[1]->b.wait_entry);
	st = dd_test_dc_stats(dc);
	KUNIT_EXPECT_EQ(test, st.unique_writes, 1);
	KUNIT_EXPECT_EQ(test, st.mapped, 1);

	/* The mapped run's content is shared; the failed one's is new. */
	again = dd_test_new_write(test, dc, 20, 21, &done);
	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, again), DD_DONE);
	KUNIT_EXPECT_EQ(test, again->r, 0);
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 20, &pba, false), 0);
	KUNIT_EXPECT_EQ(test, pba, tw[0]->b.pba);
	again = dd_test_new_write(test, dc, 21, 23, &done);
	KUNIT_EXPECT_EQ(test, dd_test_decide(dc, again), DD_STORE);
	KUNIT_EXPECT_EQ(test, again->r, 0);

	/* The waiting run is mapped once the commit is done. */
	dc->committed_seq = 1;
	list_del_init(&tw[1]->b.wait_entry);
	KUNIT_EXPECT_TRUE(test, dd_decide_stored(dc, &tw[1]->b, 0));
	KUNIT_EXPECT_EQ(test, dd_md_lookup(dc->md, 11, &pba, false), 0);
	KUNIT_EXPECT_EQ(test, pba, tw[1]->b.pba);
	KUNIT_EXPECT_EQ(test, atomic_read(&done), 0);
}

/* An append is taken, as dd_flush() does: every record made so far. */
static void dd_test_take_append(struct dedup_c *dc)
{
	down_write(&dc->lock);
	dc->appends_taken++;
	up_write(&dc->lock);
}

/*
 * Each write and discard learns which append carries its changes: the
 * next one taken after the hold that made them. A flush request may
 * join an append only if no change acknowledged before it needs a
 * later one, so a change made after a take must name the next append,
 * even if the write's earlier steps came before the take.
 */
static void dd_decide_test_append_of_each_change(struct kunit *test)
{
	struct dedup_c *dc = dd_test_dc(test, 64, 64);
	struct dd_test_write *a = dd_test_new_write(test, dc, 0, 31, NULL);
	struct dd_test_write *b = dd_test_new_write(test, dc, 1, 31, NULL);
	struct dd_test_write *z = dd_test_new_write(test, dc, 2, 0, NULL);
	u64 append = 0;

	/* Stored: decided before a take, mapped after it. */
	KUNIT_ASSERT_EQ(test, dd_test_decide_only(dc, a), DD_STORE);
	KUNIT_EXPECT_EQ(test, atomic64_read(&a->w.append), 1);
	dd_test_take_append(dc);
	a->b.run_next = NULL;
	KUNIT_EXPECT_TRUE(test, dd_decide_stored(dc, &a->b, 0));
	KUNIT_EXPECT_EQ(test, atomic64_read(&a->w.append), 2);

	/* A duplicate and a zero block: mapped in their one decision. */
	KUNIT_EXPECT_EQ(test, dd_test_decide_only(dc, b), DD_DONE);
	KUNIT_EXPECT_EQ(test, atomic64_read(&b->w.append), 2);
	dd_test_take_append(dc);
	KUNIT_EXPECT_EQ(test, dd_test_decide_only(dc, z), DD_DONE);
	KUNIT_EXPECT_EQ(test, atomic64_read(&z->w.append), 3);
	KUNIT_EXPECT_EQ(test, atomic64_read(&b->w.append), 2);

	dd_test_take_append(dc);
	KUNIT_EXPECT_EQ(test, dd_decide_unmap(dc, 0, 2, &append), 0);
	KUNIT_EXPECT_EQ(test, append, 4);

	/* What a completion raises the device's to; never lowered. */
	dd_change_acked(dc, 3);
	dd_change_acked(dc, 2);
	KUNIT_EXPECT_EQ(test, atomic64_read(&dc->acked_append), 3);
}

static struct kunit_case dd_decide_cases[] = {
	KUNIT_CASE(dd_decide_test_store_then_share),
	KUNIT_CASE(dd_decide_test_follower),
	KUNIT_CASE(dd_decide_test_candidate_died),
	KUNIT_CASE(dd_decide_test_candidate_reused),
	KUNIT_CASE(dd_decide_test_full),
	KUNIT_CASE(dd_decide_test_batch),
	KUNIT_CASE(dd_decide_test_batch_of_duplicates),
	KUNIT_CASE(dd_decide_test_batch_shares_what_it_replaces),
	KUNIT_CASE(dd_decide_test_concurrent_writers),
	KUNIT_CASE(dd_decide_test_stored_waits_for_flushing_commit),
	KUNIT_CASE(dd_decide_test_stored_runs),
	KUNIT_CASE(dd_decide_test_append_of_each_change),
	{}
};

static struct kunit_suite dd_decide_suite = {
	.name = "dm_dedup_decide",
	.test_cases = dd_decide_cases,
};

kunit_test_suite(dd_decide_suite);
