// SPDX-License-Identifier: GPL-2.0-only
/*
 * The redo journal; see dedup-journal.h and Documentation/dedup-format.rst.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/device-mapper.h>
#include <linux/gfp.h>
#include <linux/lockdep.h>
#include <linux/mm.h>
#include <linux/slab.h>

#include "dedup-journal.h"

/* Blocks read or written per I/O, and kept for reuse. */
#define DD_JOURNAL_IO_BLOCKS	32
#define DD_JOURNAL_SPARE	16

static struct dd_journal_header *dd_jh(struct page *p)
{
	return page_address(p);
}

static u8 *dd_jrecords(struct page *p)
{
	return (u8 *)page_address(p) + DD_JOURNAL_HEADER_SIZE;
}

/* Records are 8-byte multiples from an 8-byte aligned start. */
static u64 dd_jword(const u8 *rec)
{
	return le64_to_cpu(*(const __le64 *)rec);
}

/* Where in the ring the block of sequence number @seq lives. */
static u64 dd_ring_pos(const struct dd_journal_geometry *geo, u64 seq)
{
	return do_div(seq, geo->nr_blocks);
}

/* Bytes of a record of @type, key included; 0 for an unknown type. */
static u32 dd_jr_size(u8 type)
{
	switch (type) {
	case DD_JR_MAP:
	case DD_JR_REFCOUNT:
		return 16;
	case DD_JR_FINGERPRINT:
		return 8 + DD_FP_SIZE;
	case DD_JR_COUNTERS:
		return 8 + DD_JR_NR_COUNTERS * 8;
	}
	return 0;
}

int dd_journal_init(struct dd_journal *j, struct dd_bm *bm,
		    const struct dd_journal_geometry *geo, u64 next_seq)
{
	memset(j, 0, sizeof(*j));
	mutex_init(&j->lock);
	j->bm = bm;
	j->geo = *geo;
	j->next_seq = next_seq;
	/*
	 * Half the ring: an append never needs more than an epoch has left
	 * after a checkpoint came due, and the records of a long stretch
	 * without a flush cost no more than 4 MiB of memory.
	 */
	j->max_pending = geo->nr_blocks / 2;
	j->pending = kvcalloc(j->max_pending, sizeof(*j->pending), GFP_KERNEL);
	j->spare = kcalloc(DD_JOURNAL_SPARE, sizeof(*j->spare), GFP_KERNEL);
	if (!j->pending || !j->spare) {
		dd_journal_exit(j);
		return -ENOMEM;
	}
	return 0;
}

static void dd_free_pages(struct page **pages, unsigned int nr)
{
	while (nr)
		__free_page(pages[--nr]);
}

void dd_journal_exit(struct dd_journal *j)
{
	if (j->pending)
		dd_free_pages(j->pending, j->nr_pending);
	if (j->spare)
		dd_free_pages(j->spare, j->nr_spare);
	kvfree(j->pending);
	kfree(j->spare);
	j->pending = NULL;
	j->spare = NULL;
}

static struct page *dd_journal_page(struct dd_journal *j)
{
	struct page *p;

	lockdep_assert_held(&j->lock);
	p = j->nr_spare ? j->spare[--j->nr_spare] : alloc_page(GFP_NOIO);
	if (p)
		memset(page_address(p), 0, DD_BLOCK_SIZE);
	return p;
}

static void dd_journal_recycle(struct dd_journal *j, struct page **pages,
			       unsigned int nr)
{
	lockdep_assert_held(&j->lock);
	while (nr && j->nr_spare < DD_JOURNAL_SPARE)
		j->spare[j->nr_spare++] = pages[--nr];
	dd_free_pages(pages, nr);
}

/* Forget every record collected: a checkpoint holds them, or none will. */
static void dd_journal_clear(struct dd_journal *j)
{
	lockdep_assert_held(&j->lock);
	dd_journal_recycle(j, j->pending, j->nr_pending);
	j->nr_pending = 0;
	j->used = 0;
}

/* Room for @size more bytes of records, in a new block if need be. */
static u8 *dd_journal_room(struct dd_journal *j, u32 size)
{
	struct page *p;

	lockdep_assert_held(&j->lock);
	if (j->overflow)
		return NULL;
	if (!j->nr_pending || j->used + size > DD_JOURNAL_PAYLOAD) {
		p = j->nr_pending < j->max_pending ? dd_journal_page(j) : NULL;
		if (!p) {
			/* The next flush checkpoints instead of appending. */
			j->overflow = true;
			dd_journal_clear(j);
			return NULL;
		}
		if (j->nr_pending)
			dd_jh(j->pending[j->nr_pending - 1])->used =
				cpu_to_le32(j->used);
		j->pending[j->nr_pending++] = p;
		j->used = 0;
	}
	j->used += size;
	return dd_jrecords(j->pending[j->nr_pending - 1]) + j->used - size;
}

static void dd_journal_put(struct dd_journal *j, u8 type, u64 index,
			   const void *value, size_t len)
{
	u32 size = dd_jr_size(type);
	u8 *rec;

	if (WARN_ON_ONCE(!size || len > size - 8))
		return;
	rec = dd_journal_room(j, size);
	if (!rec)
		return;
	*(__le64 *)rec = cpu_to_le64((u64)type << DD_JR_TYPE_SHIFT |
				     (index & DD_JR_INDEX_MASK));
	memcpy(rec + 8, value, len);
}

/* A change, in the order made; @value is the entry's new on-disk value. */
void dd_journal_note(struct dd_journal *j, u8 type, u64 index,
		     const void *value, size_t len)
{
	mutex_lock(&j->lock);
	dd_journal_put(j, type, index, value, len);
	mutex_unlock(&j->lock);
}

/*
 * Close the records collected into one append, ending with @counters,
 * and hand its blocks to @b. -ENODATA: nothing to append (no records, and
 * not @counted: the counters moved since the last append or commit).
 * -ENOSPC: the epoch has no room for it, or records were dropped:
 * checkpoint instead.
 */
int dd_journal_take(struct dd_journal *j, const u64 *counters, bool counted,
		    u64 txn, struct dd_journal_batch *b)
{
	__le64 v[DD_JR_NR_COUNTERS];
	struct dd_journal_header *h;
	unsigned int i;
	int r = 0;

	mutex_lock(&j->lock);
	if (WARN_ON_ONCE(j->writing)) {
		r = -EBUSY;
		goto out;
	}
	if (!j->nr_pending && !j->overflow && !counted) {
		r = -ENODATA;
		goto out;
	}
	for (i = 0; i < DD_JR_NR_COUNTERS; i++)
		v[i] = cpu_to_le64(counters[i]);
	dd_journal_put(j, DD_JR_COUNTERS, 0, v, sizeof(v));
	if (j->overflow ||
	    j->next_seq + j->nr_pending > j->geo.epoch + j->geo.nr_blocks) {
		r = -ENOSPC;
		goto out;
	}
	b->pages = kmalloc_array(j->nr_pending, sizeof(*b->pages), GFP_NOIO);
	if (!b->pages) {
		r = -ENOSPC;
		goto out;
	}
	dd_jh(j->pending[j->nr_pending - 1])->used = cpu_to_le32(j->used);
	for (i = 0; i < j->nr_pending; i++) {
		h = dd_jh(j->pending[i]);
		h->hdr.type = cpu_to_le32(DD_BT_JOURNAL);
		h->hdr.blocknr = cpu_to_le64(j->geo.start +
					     dd_ring_pos(&j->geo, j->next_seq + i));
		h->hdr.txn = cpu_to_le64(txn);
		h->journal_id = cpu_to_le64(j->geo.id);
		h->epoch = cpu_to_le64(j->geo.epoch);
		h->seq = cpu_to_le64(j->next_seq + i);
		h->flags = cpu_to_le32((i + 1 == j->nr_pending ? DD_JF_END : 0) |
				       (j->geo.unflushed ? DD_JF_UNFLUSHED : 0));
		h->hdr.csum = cpu_to_le32(dd_block_csum(h));
		b->pages[i] = j->pending[i];
	}
	b->nr = j->nr_pending;
	b->first_seq = j->next_seq;
	b->unflushed = j->geo.unflushed;
	b->notify = NULL;
	if (b->unflushed) {
		j->unchecked = true;
		j->unchecked_seq = b->first_seq;
	}
	j->next_seq += j->nr_pending;
	j->nr_pending = 0;
	j->used = 0;
	j->writing = true;
out:
	mutex_unlock(&j->lock);
	return r;
}

/*
 * One append: its blocks with FUA, in at most two runs (the ring wraps).
 * Replay reads nothing that needs a flush first: the checkpoint's trees
 * were flushed when it was written, and earlier appends had FUA.
 */
int dd_journal_write(struct dd_journal *j, struct dd_journal_batch *b)
{
	unsigned int done = 0, n;
	u64 pos;
	int r = 0;

	while (!r && done < b->nr) {
		pos = dd_ring_pos(&j->geo, b->first_seq + done);
		n = min_t(u64, b->nr - done, j->geo.nr_blocks - pos);
		r = dd_bm_write_blocks(j->bm, j->geo.start + pos,
				       b->pages + done, n,
				       done + n == b->nr ? b->notify : NULL);
		done += n;
	}
	mutex_lock(&j->lock);
	if (!r) {
		j->appends++;
		j->blocks_written += b->nr;
	}
	mutex_unlock(&j->lock);
	dd_journal_drop_batch(j, b);
	return r;
}

void dd_journal_drop_batch(struct dd_journal *j, struct dd_journal_batch *b)
{
	mutex_lock(&j->lock);
	dd_journal_recycle(j, b->pages, b->nr);
	j->writing = false;
	mutex_unlock(&j->lock);
	kfree(b->pages);
	b->pages = NULL;
	b->nr = 0;
}

void dd_journal_data_stable(struct dd_journal *j)
{
	mutex_lock(&j->lock);
	WARN_ON_ONCE(j->writing);
	j->unchecked = false;
	mutex_unlock(&j->lock);
}

bool dd_journal_unchecked(struct dd_journal *j, u64 *seq)
{
	bool r;

	mutex_lock(&j->lock);
	r = j->unchecked;
	*seq = j->unchecked_seq;
	mutex_unlock(&j->lock);
	return r;
}

/*
 * The epoch of the next checkpoint's superblock: where the next append
 * will go, and never the epoch of the superblock before it, even when
 * nothing was appended in between. Two superblocks with one epoch would
 * let the older slot, used when the newer is damaged, replay appends
 * made on top of the newer state, which it does not hold
 * (Documentation/dedup-format.rst, "Epochs and stale blocks"). The
 * appends then start at the new epoch (dd_journal_checkpointed).
 */
u64 dd_journal_next_epoch(struct dd_journal *j)
{
	u64 seq;

	mutex_lock(&j->lock);
	seq = j->next_seq;
	if (j->epoch_written && seq <= j->geo.epoch)
		seq = j->geo.epoch + 1;
	mutex_unlock(&j->lock);
	return seq;
}

void dd_journal_checkpointed(struct dd_journal *j, u64 epoch, u64 id,
			     bool unflushed)
{
	mutex_lock(&j->lock);
	WARN_ON_ONCE(j->writing);
	j->geo.epoch = epoch;
	j->geo.id = id;
	/*
	 * If the checkpoint's superblock has DD_SB_UNFLUSHED_APPENDS, its
	 * appends may be written before their data is flushed.
	 */
	j->geo.unflushed = unflushed;
	j->unchecked = false;
	j->next_seq = max(j->next_seq, epoch);
	j->epoch_written = true;
	j->overflow = false;
	dd_journal_clear(j);
	mutex_unlock(&j->lock);
}

u64 dd_journal_used(struct dd_journal *j)
{
	u64 n;

	mutex_lock(&j->lock);
	n = j->next_seq - j->geo.epoch;
	mutex_unlock(&j->lock);
	return n;
}

void dd_journal_stats(struct dd_journal *j, u64 *used, u64 *appends,
		      u64 *blocks_written)
{
	mutex_lock(&j->lock);
	*used = j->next_seq - j->geo.epoch;
	*appends = j->appends;
	*blocks_written = j->blocks_written;
	mutex_unlock(&j->lock);
}

bool dd_journal_pending(struct dd_journal *j)
{
	bool r;

	mutex_lock(&j->lock);
	r = j->nr_pending || j->overflow;
	mutex_unlock(&j->lock);
	return r;
}

/* ------------------------------------------------------------------ */
/* replay */

struct dd_replay {
	struct dd_bm *bm;
	const struct dd_journal_geometry *geo;
	struct page *pages[DD_JOURNAL_IO_BLOCKS];
	u64 first;		/* the seq in pages[0] */
	unsigned int nr;	/* blocks read into pages */
};

/* The block of @seq, read with the ones after it up to the ring's end. */
static int dd_replay_block(struct dd_replay *rp, u64 seq, struct page **p)
{
	unsigned int n;
	u64 pos;
	int r;

	if (seq < rp->first || seq >= rp->first + rp->nr) {
		pos = dd_ring_pos(rp->geo, seq);
		n = min_t(u64, DD_JOURNAL_IO_BLOCKS, rp->geo->nr_blocks - pos);
		rp->nr = 0;
		r = dd_bm_read_blocks(rp->bm, rp->geo->start + pos, rp->pages,
				      n);
		if (r)
			return r;
		rp->first = seq;
		rp->nr = n;
	}
	*p = rp->pages[seq - rp->first];
	return 0;
}

/* Does the block belong to the journal at @seq? */
static bool dd_continues(const struct dd_journal_geometry *geo,
			 const struct dd_journal_header *h, u64 seq)
{
	return dd_block_csum_ok(h) &&
	       le32_to_cpu(h->hdr.type) == DD_BT_JOURNAL &&
	       le64_to_cpu(h->hdr.blocknr) ==
			geo->start + dd_ring_pos(geo, seq) &&
	       le64_to_cpu(h->journal_id) == geo->id &&
	       le64_to_cpu(h->epoch) == geo->epoch &&
	       le64_to_cpu(h->seq) == seq;
}

/*
 * Check the records of a block that continues the journal, and hand
 * them to @apply unless it is NULL. 0, or -EILSEQ with *why set.
 */
static int dd_replay_records(const struct dd_journal_geometry *geo,
			     struct page *p, dd_journal_apply_fn apply,
			     void *ctx, u64 *records, const char **why)
{
	const struct dd_journal_header *h = dd_jh(p);
	u32 used = le32_to_cpu(h->used), off = 0, size;
	const u8 *rec = dd_jrecords(p);
	u8 type = 0;
	u64 key, index;
	int r;

	if (used > DD_JOURNAL_PAYLOAD || used % 8) {
		*why = "bad record length";
		return -EILSEQ;
	}
	if (le32_to_cpu(h->flags) &
	    ~(DD_JF_END | (geo->unflushed ? DD_JF_UNFLUSHED : 0))) {
		*why = "unknown flags";
		return -EILSEQ;
	}
	while (off < used) {
		key = dd_jword(rec + off);
		type = key >> DD_JR_TYPE_SHIFT;
		index = key & DD_JR_INDEX_MASK;
		size = dd_jr_size(type);
		*why = NULL;
		if (!size || off + size > used)
			*why = "unknown record, or one crossing the end";
		else if (type == DD_JR_MAP && index >= geo->logical_blocks)
			*why = "map record beyond the logical size";
		else if ((type == DD_JR_REFCOUNT ||
			  type == DD_JR_FINGERPRINT) &&
			 index >= geo->data_blocks)
			*why = "record beyond the data device";
		else if (type == DD_JR_MAP &&
			 dd_jword(rec + off + 8) > geo->data_blocks)
			*why = "map record beyond the data device";
		else if (type == DD_JR_REFCOUNT &&
			 dd_jword(rec + off + 8) >> 32)
			*why = "refcount record above 32 bits";
		else if (type == DD_JR_COUNTERS && index)
			*why = "counters record with an index";
		if (*why)
			return -EILSEQ;
		if (apply) {
			r = apply(ctx, type, index, rec + off + 8);
			if (r)
				return r;
			(*records)++;
		}
		off += size;
	}
	if ((le32_to_cpu(h->flags) & DD_JF_END) &&
	    (!used || type != DD_JR_COUNTERS)) {
		*why = "an append that does not end with its counters";
		return -EILSEQ;
	}
	return 0;
}

/*
 * How many blocks of whole appends follow the epoch; they are checked.
 * *last: where the last whole append starts, counted from the epoch;
 * *unflushed: whether that one was written with its data flush on its
 * way.
 */
static int dd_replay_scan(struct dd_replay *rp, struct dd_journal_replayed *out,
			  u64 *whole, u64 *last, bool *unflushed)
{
	const struct dd_journal_geometry *geo = rp->geo;
	const char *why = NULL;
	struct page *p;
	u64 i, unused;
	u32 flags;
	int r;

	*whole = 0;
	*last = 0;
	*unflushed = false;
	for (i = 0; i < geo->nr_blocks; i++) {
		r = dd_replay_block(rp, geo->epoch + i, &p);
		if (r)
			return r;
		if (!dd_continues(geo, dd_jh(p), geo->epoch + i))
			break;
		r = dd_replay_records(geo, p, NULL, NULL, &unused, &why);
		if (r) {
			DMERR("%s: journal block %llu (sequence %llu) is damaged: %s",
			      dd_bm_name(rp->bm),
			      le64_to_cpu(dd_jh(p)->hdr.blocknr),
			      geo->epoch + i, why);
			return r;
		}
		flags = le32_to_cpu(dd_jh(p)->flags);
		if (flags & DD_JF_END) {
			*last = *whole;
			*unflushed = flags & DD_JF_UNFLUSHED;
			*whole = i + 1;
			out->appends++;
		}
	}
	out->torn = i - *whole;
	return 0;
}

int dd_journal_has_records(struct dd_bm *bm,
			   const struct dd_journal_geometry *geo)
{
	struct page *p;
	int r;

	p = alloc_page(GFP_NOIO);
	if (!p)
		return -ENOMEM;
	r = dd_bm_read_blocks(bm, geo->start + dd_ring_pos(geo, geo->epoch),
			      &p, 1);
	if (!r)
		r = dd_continues(geo, dd_jh(p), geo->epoch);
	__free_page(p);
	return r;
}

/*
 * Hand the records of the blocks from @first to @end (counted from the
 * epoch), which the scan checked, to @apply.
 */
static int dd_replay_range(struct dd_replay *rp, u64 first, u64 end,
			   dd_journal_apply_fn apply, void *ctx, u64 *records)
{
	const struct dd_journal_geometry *geo = rp->geo;
	const char *why;
	struct page *p;
	u64 k;
	int r = 0;

	for (k = first; !r && k < end; k++) {
		r = dd_replay_block(rp, geo->epoch + k, &p);
		/* Read again: it must still be what the scan checked. */
		if (!r && !dd_continues(geo, dd_jh(p), geo->epoch + k))
			r = -EIO;
		if (!r)
			r = dd_replay_records(geo, p, apply, ctx, records, &why);
		cond_resched();
	}
	return r;
}

/* What dd_replay_verify() hands each record of the append it checks. */
struct dd_replay_check {
	dd_journal_verify_fn verify;
	void *ctx;
	bool failed;		/* a block without its data: drop the append */
	int error;		/* a block that could not be checked */
	u64 pba;		/* the block checked last */
};

static int dd_replay_check_record(void *ctx, u8 type, u64 index,
				  const void *value)
{
	struct dd_replay_check *c = ctx;
	int r;

	if (type != DD_JR_FINGERPRINT)
		return 0;
	c->pba = index;
	r = c->verify(c->ctx, index, value);
	if (r > 0) {
		c->failed = true;
		return -ECANCELED;	/* stops the walk: the append is dropped */
	}
	c->error = r;
	return r;
}

/*
 * The blocks from @first to @end (counted from the epoch) are the last
 * whole append, written while the data it points at was being flushed:
 * does every block it made live hold its data? 0 if so, 1 if not (the
 * append was never acknowledged: drop it), < 0 if that is unknown.
 */
static int dd_replay_verify(struct dd_replay *rp, u64 first, u64 end,
			    dd_journal_verify_fn verify, void *vctx,
			    struct dd_journal_replayed *out)
{
	struct dd_replay_check c = { .verify = verify, .ctx = vctx };
	u64 unused = 0;
	int r;

	r = dd_replay_range(rp, first, end, dd_replay_check_record, &c,
			    &unused);
	if (c.error)
		DMERR("%s: journal: cannot read data block %llu to check the last append: error %d",
		      dd_bm_name(rp->bm), c.pba, c.error);
	if (!c.failed)
		return r;
	out->dropped = end - first;
	out->dropped_pba = c.pba;
	out->appends--;
	return 1;
}

int dd_journal_replay(struct dd_bm *bm, const struct dd_journal_geometry *geo,
		      dd_journal_apply_fn apply, void *ctx,
		      dd_journal_verify_fn verify, void *vctx,
		      const u64 *check_seq, struct dd_journal_replayed *out)
{
	struct dd_replay rp = { .bm = bm, .geo = geo };
	u64 whole, last;
	bool unflushed;
	unsigned int i;
	int r = 0;

	memset(out, 0, sizeof(*out));
	for (i = 0; i < DD_JOURNAL_IO_BLOCKS; i++) {
		rp.pages[i] = alloc_page(GFP_NOIO);
		if (!rp.pages[i]) {
			r = -ENOMEM;
			goto out;
		}
	}
	r = dd_replay_scan(&rp, out, &whole, &last, &unflushed);
	if (check_seq && geo->epoch + last != *check_seq)
		unflushed = false;
	if (!r && unflushed && verify) {
		r = dd_replay_verify(&rp, last, whole, verify, vctx, out);
		if (r > 0) {
			whole = last;
			r = 0;
		}
	}
	if (!r)
		r = dd_replay_range(&rp, 0, whole, apply, ctx, &out->records);
	if (!r)
		out->blocks = whole;
out:
	while (i)
		__free_page(rp.pages[--i]);
	return r;
}
