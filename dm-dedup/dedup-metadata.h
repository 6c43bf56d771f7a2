/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The persistent state of a dedup device, behind verbs named after what
 * they mean: the map (logical block -> physical block), per physical block
 * a refcount and a fingerprint, and commits. Nothing outside this unit
 * knows the disk layout.
 *
 * Locking: the caller serialises. Changes need exclusive access; lookups may
 * run concurrently with each other.
 */
#ifndef DM_DEDUP_METADATA_H
#define DM_DEDUP_METADATA_H

#include <linux/blkdev.h>
#include <linux/types.h>

#include "dedup-format.h"

struct dd_metadata;

/* Called for each live physical block while the metadata is opened. */
typedef int (*dd_fp_visit_fn)(void *ctx, u64 pba, const u8 *fp);
/* Called when a physical block loses its last reference. */
typedef void (*dd_free_fn)(void *ctx, u64 pba, const u8 *fp);
/* Called at commit for each run of physical blocks that became reusable. */
typedef void (*dd_reusable_fn)(void *ctx, u64 begin, u64 end);

struct dd_md_config {
	u64 logical_blocks;
	u64 data_blocks;
	const char *hash_name;
	u32 fp_size;
	bool read_only;
	bool identity_only;	/* check the table against it, then stop */
	dd_fp_visit_fn visit;
	dd_free_fn on_free;
	dd_reusable_fn on_reusable;
	void *ctx;
};

struct dd_md_stats {
	u64 transaction_id;
	u64 metadata_used;
	u64 metadata_total;
	u64 data_used;		/* allocated, including pending frees */
	u64 data_total;
	u64 data_live;		/* refcount > 0 */
	u64 mapped;
	u64 unique_writes;
	u64 duplicate_writes;
	u64 zero_writes;
	u64 discarded;
	u64 pending_free;
};

#define DD_REFCOUNT_MAX		U32_MAX

u64 dd_md_required_blocks(u64 logical_blocks, u64 data_blocks);

int dd_md_open(struct block_device *bdev, const struct dd_md_config *cfg,
	       struct dd_metadata **mdp, char **error);
void dd_md_close(struct dd_metadata *md);

int dd_md_lookup(struct dd_metadata *md, u64 lba, u64 *pba, bool nowait);
int dd_md_get_fingerprint(struct dd_metadata *md, u64 pba, u8 *fp);
int dd_md_get_refcount(struct dd_metadata *md, u64 pba, u32 *count);

int dd_md_alloc_data(struct dd_metadata *md, u64 *pba);
void dd_md_free_data_now(struct dd_metadata *md, u64 pba);
int dd_md_get_ref(struct dd_metadata *md, u64 pba);
int dd_md_put_ref(struct dd_metadata *md, u64 pba);
int dd_md_map_new(struct dd_metadata *md, u64 lba, u64 pba, const u8 *fp);
int dd_md_map_claimed(struct dd_metadata *md, u64 lba, u64 pba);
int dd_md_map_zero(struct dd_metadata *md, u64 lba);
int dd_md_unmap_range(struct dd_metadata *md, u64 begin, u64 end,
		      u64 *unmapped);

int dd_md_commit(struct dd_metadata *md);
void dd_md_abort(struct dd_metadata *md);
bool dd_md_dirty(struct dd_metadata *md);
int dd_md_writeback_error(struct dd_metadata *md);
void dd_md_stats(struct dd_metadata *md, struct dd_md_stats *st);
u64 dd_md_free_data_blocks(struct dd_metadata *md);
u64 dd_md_pending_data_frees(struct dd_metadata *md);

#endif
