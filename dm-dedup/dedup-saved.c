// SPDX-License-Identifier: GPL-2.0-only
/*
 * The state saved at a clean close; see dedup-saved.h.
 */
#include <linux/kernel.h>
#include <linux/math.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/string.h>

#include "dedup-array.h"
#include "dedup-saved.h"

#define DD_WORDS_PER_LEAF	(DD_PAYLOAD_SIZE / sizeof(__le64))

/* Where each part starts, in words. */
struct dd_saved_layout {
	u64 meta_words;
	u64 data_words;
	u64 data_start;
	u64 target_start;
	u64 total;
};

static void dd_saved_layout(struct dd_saved_layout *l, u64 meta_blocks,
			    u64 data_blocks, u64 target_words)
{
	l->meta_words = DIV_ROUND_UP_ULL(meta_blocks, 64);
	l->data_words = DIV_ROUND_UP_ULL(data_blocks, 64);
	l->data_start = DD_SAVED_HEADER_WORDS + l->meta_words;
	l->target_start = l->data_start + l->data_words;
	l->total = l->target_start + target_words;
}

struct dd_saved_writer {
	struct dd_saved_layout l;
	u64 header[DD_SAVED_HEADER_WORDS];
	u64 *meta;		/* the trees' blocks, before the save took any */
	const struct dd_space *data;
	const struct dd_md_saved *saved;
};

static u64 dd_saved_word(const struct dd_saved_writer *w, u64 i)
{
	if (i < DD_SAVED_HEADER_WORDS)
		return w->header[i];
	if (i < w->l.data_start)
		return w->meta[i - DD_SAVED_HEADER_WORDS];
	if (i < w->l.target_start)
		return dd_space_committed_word(w->data, i - w->l.data_start);
	return w->saved->words[i - w->l.target_start];
}

static int dd_saved_write_leaves(struct dd_array *a,
				 const struct dd_saved_writer *w, __le64 *buf)
{
	u64 leaf, first, i;
	struct dd_block blk;
	bool zero;
	void *entry;
	u32 n;
	int r;

	for (leaf = 0; leaf * DD_WORDS_PER_LEAF < w->l.total; leaf++) {
		cond_resched();
		first = leaf * DD_WORDS_PER_LEAF;
		n = min_t(u64, DD_WORDS_PER_LEAF, w->l.total - first);
		zero = true;
		for (i = 0; i < n; i++) {
			buf[i] = cpu_to_le64(dd_saved_word(w, first + i));
			zero &= !buf[i];
		}
		/* An absent leaf reads as zeros; leaf 0 holds the header. */
		if (zero)
			continue;
		r = dd_array_update(a, first, &blk, &entry);
		if (r)
			return r;
		memcpy(entry, buf, n * sizeof(*buf));
		dd_bm_release_dirty(&blk);
	}
	return 0;
}

int dd_saved_write(struct dd_bm *bm, const struct dd_space *data,
		   const struct dd_md_saved *saved, void *leaf_buf, u64 *root,
		   u64 *nr_words)
{
	struct dd_saved_writer w = { .data = data, .saved = saved };
	struct dd_array a;
	u64 k;
	int r;

	dd_saved_layout(&w.l, bm->nr_blocks, data->nr_blocks, saved->nr_words);
	w.header[DD_SAVED_W_MAGIC] = DD_SAVED_MAGIC;
	w.header[DD_SAVED_W_TXN] = bm->txn;
	w.header[DD_SAVED_W_METADATA_BLOCKS] = bm->nr_blocks;
	w.header[DD_SAVED_W_DATA_BLOCKS] = data->nr_blocks;
	w.header[DD_SAVED_W_TARGET_WORDS] = saved->nr_words;
	memcpy(&w.header[DD_SAVED_W_TARGET_HEAD], saved->head,
	       sizeof(saved->head));
	w.meta = kvmalloc_array(w.l.meta_words, sizeof(u64), GFP_KERNEL);
	if (!w.meta)
		return -ENOMEM;
	for (k = 0; k < w.l.meta_words; k++)
		w.meta[k] = dd_space_committed_word(&bm->space, k);

	dd_array_init(&a, bm, DD_ARRAY_SAVED, sizeof(__le64), w.l.total, 0);
	r = dd_saved_write_leaves(&a, &w, leaf_buf);
	kvfree(w.meta);
	if (r)
		return r;
	*root = a.root;
	*nr_words = w.l.total;
	return 0;
}

struct dd_saved_reader {
	struct dd_saved_layout l;
	u64 txn;
	u64 meta_blocks;
	u64 layout;		/* the target's head[0] */
	u64 *meta;
	struct dd_space *data;
	struct dd_md_saved *saved;
	bool header_seen;
	const char *why;
};

static int dd_saved_header(struct dd_saved_reader *rd, const __le64 *h,
			   u32 count)
{
	if (count < DD_SAVED_HEADER_WORDS ||
	    le64_to_cpu(h[DD_SAVED_W_MAGIC]) != DD_SAVED_MAGIC) {
		rd->why = "no header";
		return -EILSEQ;
	}
	if (le64_to_cpu(h[DD_SAVED_W_TXN]) != rd->txn) {
		rd->why = "written for another superblock";
		return -ESTALE;
	}
	if (le64_to_cpu(h[DD_SAVED_W_METADATA_BLOCKS]) != rd->meta_blocks ||
	    le64_to_cpu(h[DD_SAVED_W_DATA_BLOCKS]) != rd->data->nr_blocks ||
	    le64_to_cpu(h[DD_SAVED_W_TARGET_WORDS]) != rd->saved->nr_words) {
		rd->why = "the devices' sizes changed";
		return -ESTALE;
	}
	if (le64_to_cpu(h[DD_SAVED_W_TARGET_HEAD]) != rd->layout) {
		rd->why = "saved by a module with another index layout";
		return -ESTALE;
	}
	rd->header_seen = true;
	return 0;
}

/* One present leaf of the save, in order; absent ones read as zeros. */
static int dd_saved_leaf(void *ctx, u64 first, const void *entries, u32 count)
{
	const __le64 *w = entries;
	struct dd_saved_reader *rd = ctx;
	u64 i, v;
	u32 j;
	int r;

	if (!first) {
		r = dd_saved_header(rd, w, count);
		if (r)
			return r;
	} else if (!rd->header_seen) {
		rd->why = "no header";
		return -EILSEQ;
	}
	for (j = 0; j < count; j++) {
		i = first + j;
		v = le64_to_cpu(w[j]);
		if (i < DD_SAVED_HEADER_WORDS) {
			if (i >= DD_SAVED_W_TARGET_HEAD)
				rd->saved->head[i - DD_SAVED_W_TARGET_HEAD] = v;
		} else if (i < rd->l.data_start) {
			rd->meta[i - DD_SAVED_HEADER_WORDS] = v;
		} else if (i < rd->l.target_start) {
			if (dd_space_load_word(rd->data, i - rd->l.data_start,
					       v)) {
				rd->why = "data bitmap out of range";
				return -EILSEQ;
			}
		} else {
			rd->saved->words[i - rd->l.target_start] = v;
		}
	}
	return 0;
}

int dd_saved_load(struct dd_bm *bm, struct dd_space *data, u64 root,
		  u64 nr_words, u64 txn, struct dd_md_saved *saved,
		  const char **why)
{
	struct dd_saved_reader rd = {
		.txn = txn, .meta_blocks = bm->nr_blocks, .data = data,
		.saved = saved, .why = "unreadable",
		.layout = saved->head[0],
	};
	struct dd_array a;
	u64 k;
	int r;

	dd_saved_layout(&rd.l, bm->nr_blocks, data->nr_blocks, saved->nr_words);
	if (nr_words != rd.l.total) {
		*why = "the devices' sizes changed";
		return -ESTALE;
	}
	rd.meta = kvcalloc(rd.l.meta_words, sizeof(u64), GFP_KERNEL);
	if (!rd.meta) {
		*why = "out of memory";
		return -ENOMEM;
	}
	dd_array_init(&a, bm, DD_ARRAY_SAVED, sizeof(__le64), nr_words, root);
	/* Takes the save's own blocks in bm->space as it goes. */
	r = dd_array_walk(&a, dd_saved_leaf, &rd);
	if (!r && !rd.header_seen) {
		rd.why = "no header";
		r = -EILSEQ;
	}
	if (!r) {
		/* Only the loaded superblock names them: free at the next commit. */
		dd_space_release_all(&bm->space);
		rd.why = "metadata bitmap overlaps the save or is out of range";
		for (k = 0; k < rd.l.meta_words && !r; k++)
			r = dd_space_load_word(&bm->space, k, rd.meta[k]);
	}
	kvfree(rd.meta);
	if (r)
		*why = rd.why;
	return r;
}
