// SPDX-License-Identifier: GPL-2.0-only
/*
 * dm-dedup: device-mapper target that deduplicates 4 KiB blocks inline.
 *
 * This file is the target as device-mapper sees it: the table line, the
 * constructor and destructor, status and messages, suspend and resume.
 * The I/O path lives in dedup-io.c, dedup-decide.c and dedup-commit.c;
 * dedup-target.h says what they share and how they lock.
 */
#define DM_MSG_PREFIX "dedup"

#include <linux/cpumask.h>
#include <linux/module.h>
#include <linux/slab.h>

#include "dedup-target.h"

#define DD_DEFAULT_HASH			"sha256"
#define DD_DEFAULT_COMMIT_INTERVAL	1	/* seconds */
#define DD_MAX_COMMIT_INTERVAL		3600
/* One discard bio at most; dedup-decide.c unmaps it in smaller chunks. */
#define DD_MAX_DISCARD_SECTORS		(64ULL << (20 - SECTOR_SHIFT))
/*
 * Copies of data blocks kept in reserve for writes (1 MiB). A writer that
 * finds none free waits in map until a write completes.
 */
#define DD_DATA_RESERVE			256
/* Block arrays of multi-block writes kept in reserve (see DD_DATA_RESERVE). */
#define DD_BATCH_RESERVE		4
/* Writes in flight whose state is kept in reserve, as the data blocks. */
#define DD_WRITE_RESERVE		64

/*
 * Every constructed dedup target, so that a table reload of the same
 * device can defer opening the metadata until the old table is suspended,
 * and another device cannot open metadata or data that is in use.
 */
static LIST_HEAD(dd_instances);
static DEFINE_MUTEX(dd_instances_lock);

/* ------------------------------------------------------------------ */
/* target methods */

static int dedup_map(struct dm_target *ti, struct bio *bio)
{
	return dd_io_map(ti->private, bio);
}

static int dedup_end_io(struct dm_target *ti, struct bio *bio,
			blk_status_t *error)
{
	dd_io_end(ti->private, bio);
	return DM_ENDIO_DONE;
}

static void dedup_status(struct dm_target *ti, status_type_t type,
			 unsigned int status_flags, char *result,
			 unsigned int maxlen)
{
	struct dedup_c *dc = ti->private;
	struct dd_md_stats st;
	unsigned int sz = 0, nr_opts;

	switch (type) {
	case STATUSTYPE_INFO:
		if (!dc->md) {
			/* A reloaded table before its first resume. */
			DMEMIT("inactive");
			break;
		}
		/* A snapshot under the metadata lock; no wait for commits. */
		dd_md_stats(dc->md, &st);
		DMEMIT("%s %llu %llu/%llu %llu/%llu %llu %llu %llu %llu %llu %s %s %s %llu/%llu",
		       dd_mode_names[READ_ONCE(dc->mode)], st.transaction_id,
		       st.metadata_used, st.metadata_total, st.data_used,
		       st.data_total, st.mapped, st.unique_writes,
		       st.duplicate_writes, st.zero_writes, st.discarded,
		       dd_hasher_name(&dc->hasher),
		       dc->verify ? "verify" : "no_verify",
		       dc->discard_passdown ? "discard_passdown" :
					      "no_discard_passdown",
		       st.journal_used, st.journal_total);
		break;
	case STATUSTYPE_TABLE:
		nr_opts = 2 * !!strcmp(dd_hasher_name(&dc->hasher),
				       DD_DEFAULT_HASH) +
			  dc->verify +
			  2 * (dc->commit_interval != DD_DEFAULT_COMMIT_INTERVAL) +
			  dc->discard_passdown + 2 * !!dc->low_water_mark +
			  dc->early_ack + dc->read_only_opt +
			  dc->no_read_batching;
		DMEMIT("%s %s", dc->meta_dev->name, dc->data_dev->name);
		if (nr_opts)
			DMEMIT(" %u", nr_opts);
		if (strcmp(dd_hasher_name(&dc->hasher), DD_DEFAULT_HASH))
			DMEMIT(" hash %s", dd_hasher_name(&dc->hasher));
		if (dc->verify)
			DMEMIT(" verify");
		if (dc->commit_interval != DD_DEFAULT_COMMIT_INTERVAL)
			DMEMIT(" commit_interval %u", dc->commit_interval);
		if (dc->discard_passdown)
			DMEMIT(" discard_passdown");
		if (dc->low_water_mark)
			DMEMIT(" low_water_mark %llu", dc->low_water_mark);
		if (dc->early_ack)
			DMEMIT(" early_ack");
		if (dc->read_only_opt)
			DMEMIT(" read_only");
		if (dc->no_read_batching)
			DMEMIT(" no_read_batching");
		break;
	case STATUSTYPE_IMA:
		*result = '\0';
		break;
	}
}

static int dd_message_stats(struct dedup_c *dc, char *result,
			    unsigned int maxlen)
{
	u64 index_bytes = dd_index_bytes(&dc->index);
	unsigned int sz = 0;
	struct dd_md_stats st;
	u64 written, skipped;

	dd_md_stats(dc->md, &st);
	written = st.unique_writes + st.duplicate_writes + st.zero_writes;

	DMEMIT("mode %s\n", dd_mode_names[READ_ONCE(dc->mode)]);
	DMEMIT("transaction_id %llu\n", st.transaction_id);
	DMEMIT("logical_blocks %llu\n", dc->logical_blocks);
	DMEMIT("mapped_blocks %llu\n", st.mapped);
	DMEMIT("data_blocks_total %llu\n", st.data_total);
	DMEMIT("data_blocks_used %llu\n", st.data_used);
	DMEMIT("data_blocks_live %llu\n", st.data_live);
	DMEMIT("data_blocks_pending_free %llu\n", st.pending_free);
	DMEMIT("metadata_blocks_total %llu\n", st.metadata_total);
	DMEMIT("metadata_blocks_used %llu\n", st.metadata_used);
	DMEMIT("unique_writes %llu\n", st.unique_writes);
	DMEMIT("duplicate_writes %llu\n", st.duplicate_writes);
	DMEMIT("in_place_changes %llu\n", st.in_place_changes);
	DMEMIT("zero_writes %llu\n", st.zero_writes);
	DMEMIT("discarded_blocks %llu\n", st.discarded);
	DMEMIT("journal_blocks_used %llu\n", st.journal_used);
	DMEMIT("journal_blocks_total %llu\n", st.journal_total);
	DMEMIT("journal_appends %llu\n", st.journal_appends);
	DMEMIT("journal_blocks_written %llu\n", st.journal_blocks_written);
	DMEMIT("journal_blocks_replayed %llu\n", st.journal_replayed);
	DMEMIT("journal_blocks_dropped %llu\n", st.journal_dropped);
	DMEMIT("checkpoints %llu\n", st.checkpoints);
	DMEMIT("commit_hold_us %llu\n",
	       div_u64(READ_ONCE(dc->commit_hold_ns), NSEC_PER_USEC));
	DMEMIT("commit_hold_max_us %llu\n",
	       div_u64(READ_ONCE(dc->commit_hold_max_ns), NSEC_PER_USEC));
	skipped = READ_ONCE(dc->data_flushes_skipped);
	/*
	 * Pairs with the barrier after flush_seq is raised, before a flush
	 * is sent or skipped: a skip under way counts as sent for now, and
	 * the skips never outnumber the flushes.
	 */
	smp_rmb();
	DMEMIT("data_flushes %llu\n", READ_ONCE(dc->flush_seq) - skipped);
	DMEMIT("data_flushes_skipped %llu\n", skipped);
	DMEMIT("data_flushes_ahead %llu\n",
	       (u64)atomic64_read(&dc->data_flushes_ahead));
	DMEMIT("appends_ahead %llu\n",
	       (u64)atomic64_read(&dc->appends_ahead));
	DMEMIT("appends_joined %llu\n",
	       (u64)atomic64_read(&dc->appends_joined));
	/* Percentages in hundredths, to stay in integer arithmetic. */
	DMEMIT("dedup_ratio_x100 %llu\n",
	       st.data_live ? div64_u64(st.mapped * 100, st.data_live) : 100);
	DMEMIT("write_savings_x100 %llu\n",
	       written ? div64_u64((written - st.unique_writes) * 10000,
				   written) : 0);
	DMEMIT("index_bytes %llu\n", index_bytes);
	DMEMIT("index_bytes_per_data_block_x100 %llu\n",
	       div64_u64(index_bytes * 100, st.data_total));
	DMEMIT("data_space_bytes %llu\n", st.data_space_bytes);
	DMEMIT("ram_bytes_per_data_block_x100 %llu\n",
	       div64_u64((index_bytes + st.data_space_bytes) * 100,
			 st.data_total));
	DMEMIT("index_entries %llu\n", READ_ONCE(dc->index.nr_entries));
	DMEMIT("index_full %lld\n", atomic64_read(&dc->index_full));
	DMEMIT("index_candidates %lld\n",
	       atomic64_read(&dc->index_candidates));
	DMEMIT("index_false_candidates %lld\n",
	       atomic64_read(&dc->index_false_candidates));
	DMEMIT("index_loaded %d\n", dc->index_loaded);
	DMEMIT("activation_ms %llu\n", dc->activation_ms);
	DMEMIT("verify_mismatches %lld\n",
	       atomic64_read(&dc->verify_mismatches));
	DMEMIT("verify_reads %lld\n", atomic64_read(&dc->verify_reads));
	DMEMIT("nospc_errors %lld\n", atomic64_read(&dc->nospc_errors));
	DMEMIT("data_write_errors %lld\n",
	       atomic64_read(&dc->data_write_errors));
	DMEMIT("deferred_reads %lld\n", atomic64_read(&dc->deferred_reads));
	DMEMIT("read_batches %lld\n", atomic64_read(&dc->read_batches));
	DMEMIT("batched_reads %lld\n", atomic64_read(&dc->batched_reads));
	DMEMIT("early_acks %lld\n", atomic64_read(&dc->early_acks));
	DMEMIT("early_acks_undecided %lld\n",
	       atomic64_read(&dc->early_acks_undecided));
	DMEMIT("early_acked_blocks_in_flight %u\n", READ_ONCE(dc->acked_blocks));
	DMEMIT("ordered_waits %llu\n", READ_ONCE(dc->cells.waits));
	DMEMIT("discard_passdown_blocks %lld\n",
	       atomic64_read(&dc->discard_passdown_blocks));
	DMEMIT("hash %s\n", dd_hasher_name(&dc->hasher));
	return 1;
}

static int dedup_message(struct dm_target *ti, unsigned int argc, char **argv,
			 char *result, unsigned int maxlen)
{
	struct dedup_c *dc = ti->private;

	if (!dc->md) {
		/* Loaded but never resumed, or its resume failed. */
		DMERR("%s: message refused: the table is not active (resume it first)",
		      dd_name(dc));
		return -EINVAL;
	}
	if (argc == 1 && !strcasecmp(argv[0], "stats"))
		return dd_message_stats(dc, result, maxlen);
	if (argc == 1 && !strcasecmp(argv[0], "commit"))
		return dd_commit_settled(dc);
	DMERR("%s: unknown message (expected: stats, commit)", dd_name(dc));
	return -EINVAL;
}

static void dedup_io_hints(struct dm_target *ti, struct queue_limits *limits)
{
	limits->logical_block_size = DD_BLOCK_SIZE;
	limits->physical_block_size = DD_BLOCK_SIZE;
	limits->io_min = DD_BLOCK_SIZE;
	limits->discard_granularity = DD_BLOCK_SIZE;
	limits->max_hw_discard_sectors = DD_MAX_DISCARD_SECTORS;
	limits->max_write_zeroes_sectors = DD_MAX_DISCARD_SECTORS;
}

static int dedup_iterate_devices(struct dm_target *ti,
				 iterate_devices_callout_fn fn, void *data)
{
	struct dedup_c *dc = ti->private;

	/*
	 * Only the data device holds what the logical blocks read, and it
	 * may be smaller than the logical size.
	 */
	return fn(ti, dc->data_dev, 0, dc->data_blocks * DD_SECTORS_PER_BLOCK,
		  data);
}

static void dedup_postsuspend(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;

	if (!dc->md)
		return;
	/* Writes acknowledged early are no bios in flight for dm core. */
	dd_io_drain(dc);
	dd_commit_stop(dc);
	/*
	 * Settled: no block left cooling, so nothing is dirty and the
	 * destructor, which may run after a reloaded table has taken over
	 * the metadata, has nothing left to commit.
	 */
	dd_commit_settled(dc);
	/*
	 * A failed final commit may have queued the needs_check superblock
	 * write: it must land before a reloaded table opens the metadata.
	 */
	flush_workqueue(dc->commit_wq);
}

static int dd_open_metadata(struct dedup_c *dc, struct dm_target *ti,
			    bool identity_only, char **error);

/*
 * A reloaded table opens the metadata only now: the table it replaces was
 * suspended, so everything it wrote is committed.
 */
static int dedup_preresume(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;
	char *error = NULL;
	int r;

	if (dc->md)
		return 0;
	r = dd_open_metadata(dc, ti, false, &error);
	if (r)
		DMERR("%s: cannot open the metadata: %s", dd_name(dc),
		      error ? error : "error");
	return r;
}

static void dedup_resume(struct dm_target *ti)
{
	dd_commit_start(ti->private);
}

/* ------------------------------------------------------------------ */
/* construction */

static int dd_parse_options(struct dedup_c *dc, struct dm_arg_set *as,
			    const char **hash, char **error)
{
	static const struct dm_arg nr_opts = {0, 11, "Invalid number of optional arguments"};
	static const struct dm_arg interval = {1, DD_MAX_COMMIT_INTERVAL,
		"Invalid commit_interval (seconds, 1-3600)"};
	unsigned int count;
	const char *opt;
	int r;

	if (!as->argc)
		return 0;
	r = dm_read_arg_group(&nr_opts, as, &count, error);
	if (r)
		return r;
	if (as->argc != count) {
		*error = "Too many arguments (more than the optional argument count says)";
		return -EINVAL;
	}
	while (count--) {
		opt = dm_shift_arg(as);
		if (!strcasecmp(opt, "verify")) {
			dc->verify = true;
		} else if (!strcasecmp(opt, "discard_passdown")) {
			dc->discard_passdown = true;
		} else if (!strcasecmp(opt, "early_ack")) {
			dc->early_ack = true;
		} else if (!strcasecmp(opt, "read_only")) {
			dc->read_only_opt = true;
		} else if (!strcasecmp(opt, "no_read_batching")) {
			dc->no_read_batching = true;
		} else if (!strcasecmp(opt, "hash") && count) {
			*hash = dm_shift_arg(as);
			count--;
		} else if (!strcasecmp(opt, "commit_interval") && count) {
			r = dm_read_arg(&interval, as, &dc->commit_interval,
					error);
			if (r)
				return r;
			count--;
		} else if (!strcasecmp(opt, "low_water_mark") && count) {
			if (kstrtoull(dm_shift_arg(as), 10, &dc->low_water_mark)) {
				*error = "Invalid low_water_mark (a number of data blocks)";
				return -EINVAL;
			}
			count--;
		} else {
			*error = "Unknown or incomplete optional argument";
			return -EINVAL;
		}
	}
	return 0;
}

/*
 * The claim on the devices goes last: until the metadata is closed, and
 * with it every write of this instance done, no other target may open it.
 */
static void dd_destroy(struct dedup_c *dc)
{
	if (dc->commit_wq)
		destroy_workqueue(dc->commit_wq);
	if (dc->wq)
		destroy_workqueue(dc->wq);
	if (dc->read_wq)
		destroy_workqueue(dc->read_wq);
	if (dc->md)
		dd_md_close(dc->md);
	dd_index_exit(&dc->index);
	dd_hasher_exit(&dc->hasher);
	dd_data_pool_exit(&dc->data_pool);
	mempool_exit(&dc->batch_pool);
	mempool_exit(&dc->write_pool);
	bioset_exit(&dc->bs);
	/* Off the list first: a constructor looks at its devices there. */
	mutex_lock(&dd_instances_lock);
	list_del(&dc->instance);
	mutex_unlock(&dd_instances_lock);
	if (dc->data_dev)
		dm_put_device(dc->ti, dc->data_dev);
	if (dc->meta_dev)
		dm_put_device(dc->ti, dc->meta_dev);
	kfree(dc);
}

static int dd_open_devices(struct dedup_c *dc, struct dm_target *ti,
			   char **argv)
{
	blk_mode_t mode = dc->read_only ? BLK_OPEN_READ :
			  dm_table_get_mode(ti->table);
	int r;

	r = dm_get_device(ti, argv[0], mode, &dc->meta_dev);
	if (r) {
		ti->error = "Cannot open metadata device";
		return r;
	}
	r = dm_get_device(ti, argv[1], mode, &dc->data_dev);
	if (r) {
		ti->error = "Cannot open data device";
		return r;
	}
	if (dc->meta_dev->bdev == dc->data_dev->bdev) {
		ti->error = "Metadata and data devices must differ";
		return -EINVAL;
	}
	dc->data_blocks = bdev_nr_bytes(dc->data_dev->bdev) >> DD_BLOCK_SHIFT;
	if (!dc->data_blocks) {
		ti->error = "Data device is smaller than one 4 KiB block";
		return -EINVAL;
	}
	if (dc->data_blocks - 1 > DD_INDEX_MAX_PBA) {
		ti->error = "Data device too large (at most 2^40 - 1 blocks)";
		return -EINVAL;
	}
	return 0;
}

static int dd_open_metadata(struct dedup_c *dc, struct dm_target *ti,
			    bool identity_only, char **error)
{
	struct dd_md_config cfg = {
		.name = dd_name(dc),
		.logical_blocks = dc->logical_blocks,
		.data_blocks = dc->data_blocks,
		.hash_name = dd_hasher_name(&dc->hasher),
		.fp_size = dc->hasher.fp_size,
		.read_only = dc->read_only,
		.hold_frees = dc->discard_passdown,
		.identity_only = identity_only,
		.flush_first = !dc->hasher.strong,
		.visit = dd_index_visit,
		.verify = dd_journal_data_verify,
		.flush_data = dd_journal_data_flush,
		.saved_ok = dd_index_saved_ok,
		.ctx = dc,
	};
	struct dd_md_saved saved;
	struct dd_metadata *md;
	ktime_t start = ktime_get();
	int r;

	if (identity_only) {
		r = dd_md_open(dc->meta_dev->bdev, &cfg, &md, error);
		if (!r)
			dd_md_close(md);
		return r;
	}

	r = dd_index_init(&dc->index, dc->data_blocks);
	if (r) {
		DMERR("cannot allocate the fingerprint index: %llu MiB",
		      (u64)(dc->data_blocks + dc->data_blocks / 4) * 8 >> 20);
		*error = "Cannot allocate the fingerprint index";
		return r;
	}
	dd_index_saved_view(dc, &saved);
	cfg.saved = &saved;
	r = dd_md_open(dc->meta_dev->bdev, &cfg, &dc->md, error);
	if (r) {
		dd_index_exit(&dc->index);
		return r;
	}
	if (saved.loaded)
		dd_index_saved_adopt(dc, &saved);
	dc->index_loaded = saved.loaded;
	dc->activation_ms = ktime_ms_delta(ktime_get(), start);
	if (saved.why == dd_index_walk_due)
		DMINFO("%s: saved state %s", dd_name(dc), saved.why);
	else if (saved.why)
		DMWARN("%s: saved state not usable (%s); rebuilding it",
		       dd_name(dc), saved.why);
	if (saved.loaded || dc->index.nr_entries)
		DMINFO("%s: index of %llu blocks %s in %llu ms", dd_name(dc),
		       dc->index.nr_entries,
		       saved.loaded ? "loaded from the last clean close" :
				      "rebuilt from the metadata",
		       dc->activation_ms);
	if (dd_md_needs_check(dc->md)) {
		WRITE_ONCE(dc->mode, DD_MODE_NEEDS_CHECK);
		DMERR("%s: metadata flagged needs_check: read-only; run dedup check",
		      dd_name(dc));
	}
	return 0;
}

/* Called with dd_instances_lock held. */
static int dd_claim_devices(struct dedup_c *dc, bool *reload)
{
	struct mapped_device *md = dm_table_get_md(dc->ti->table);
	struct block_device *meta = dc->meta_dev->bdev;
	struct block_device *data = dc->data_dev->bdev;
	struct dedup_c *other;

	*reload = false;
	list_for_each_entry(other, &dd_instances, instance) {
		bool same_meta = other->meta_dev->bdev == meta;

		if (!same_meta && other->data_dev->bdev != data &&
		    other->meta_dev->bdev != data && other->data_dev->bdev != meta)
			continue;
		/*
		 * Only a table replacing this device's own may share the
		 * devices; two targets of one table never may.
		 */
		if (dm_table_get_md(other->ti->table) != md || !same_meta ||
		    other->data_dev->bdev != data ||
		    other->ti->table == dc->ti->table) {
			dc->ti->error = "Device already in use by another dedup target";
			return -EBUSY;
		}
		*reload = true;
	}
	return 0;
}

/*
 * <metadata dev> <data dev> [<#opt args> [hash <alg>] [verify]
 *   [commit_interval <s>] [discard_passdown] [low_water_mark <blocks>]
 *   [early_ack] [read_only] [no_read_batching]]
 */
static int dedup_ctr(struct dm_target *ti, unsigned int argc, char **argv)
{
	struct dm_arg_set as = { .argc = argc - 2, .argv = argv + 2 };
	const char *hash = DD_DEFAULT_HASH;
	struct dedup_c *dc;
	bool reload;
	int r;

	if (argc < 2) {
		ti->error = "Missing arguments: <metadata dev> <data dev> [<#opt args> ...]";
		return -EINVAL;
	}
	if (ti->begin % DD_SECTORS_PER_BLOCK || ti->len % DD_SECTORS_PER_BLOCK ||
	    !ti->len) {
		ti->error = "Start and length must be non-zero multiples of 8 sectors (4 KiB)";
		return -EINVAL;
	}
	dc = kzalloc(sizeof(*dc), GFP_KERNEL);
	if (!dc) {
		ti->error = "Out of memory";
		return -ENOMEM;
	}
	dc->ti = ti;
	INIT_LIST_HEAD(&dc->instance);
	dc->commit_interval = DD_DEFAULT_COMMIT_INTERVAL;
	dc->logical_blocks = ti->len / DD_SECTORS_PER_BLOCK;
	dd_commit_init(dc);
	dd_decide_init(dc);
	dd_io_init(dc);

	r = dd_parse_options(dc, &as, &hash, &ti->error);
	if (r)
		goto bad;
	/*
	 * A table loaded read-only (dmsetup --readonly) opens the devices
	 * read-only: it must not write metadata through them either.
	 */
	dc->read_only = dc->read_only_opt ||
			!(dm_table_get_mode(ti->table) & BLK_OPEN_WRITE);
	dc->mode = dc->read_only ? DD_MODE_RO : DD_MODE_RW;
	r = dd_hasher_init(&dc->hasher, hash, &ti->error);
	if (r)
		goto bad;
	if (!dc->hasher.strong && !dc->verify) {
		ti->error = "Hash is not collision resistant: add the 'verify' option to use it";
		r = -EINVAL;
		goto bad;
	}
	r = dd_open_devices(dc, ti, argv);
	if (r)
		goto bad;
	r = bioset_init(&dc->bs, 256, 0, BIOSET_NEED_BVECS);
	if (r) {
		ti->error = "Cannot allocate bio set";
		goto bad;
	}
	r = dd_data_pool_init(&dc->data_pool, DD_DATA_RESERVE);
	if (r) {
		ti->error = "Cannot allocate the reserve of data block copies";
		goto bad;
	}
	r = mempool_init_kmalloc_pool(&dc->write_pool, DD_WRITE_RESERVE,
				      sizeof(struct dd_write));
	if (!r)
		r = mempool_init_kmalloc_pool(&dc->batch_pool, DD_BATCH_RESERVE,
					      DD_BIO_BLOCKS * DD_BATCH_BYTES);
	if (r) {
		ti->error = "Cannot allocate the reserve of write batches";
		goto bad;
	}
	mutex_lock(&dd_instances_lock);
	r = dd_claim_devices(dc, &reload);
	if (!r)
		r = dd_open_metadata(dc, ti, reload, &ti->error);
	if (!r)
		list_add(&dc->instance, &dd_instances);
	mutex_unlock(&dd_instances_lock);
	if (r)
		goto bad;
	/*
	 * As many work items at once as CPUs: more only take turns on the
	 * metadata locks, and a holder switched out for one of them stalls
	 * the others (Documentation/benchmarks.rst, "As many I/O workers as
	 * CPUs"). No work item here waits for one still queued: the
	 * commit, which they wait for through dc->lock, runs on its own
	 * queue and waits only for I/O and for the steps holding dc->lock
	 * shared, which wait for nothing queued here either.
	 */
	dc->wq = alloc_workqueue("dedup-io", WQ_UNBOUND | WQ_MEM_RECLAIM,
				 max(2U, num_online_cpus()));
	dc->read_wq = alloc_workqueue("dedup-read", WQ_UNBOUND | WQ_MEM_RECLAIM,
				      1);
	dc->commit_wq = alloc_ordered_workqueue("dedup-commit", WQ_MEM_RECLAIM);
	if (!dc->wq || !dc->read_wq || !dc->commit_wq) {
		ti->error = "Cannot allocate workqueues";
		r = -ENOMEM;
		goto bad;
	}

	ti->private = dc;
	ti->num_flush_bios = 1;
	ti->flush_supported = true;
	ti->num_discard_bios = 1;
	ti->discards_supported = true;
	ti->num_write_zeroes_bios = 1;
	ti->per_io_data_size = sizeof(struct dd_io);
	r = dm_set_target_max_io_len(ti, DD_BIO_BLOCKS * DD_SECTORS_PER_BLOCK);
	if (r)
		goto bad;
	DMINFO("%s: %llu logical blocks over %llu data blocks, index %zu KiB, hash %s%s%s",
	       dd_name(dc), dc->logical_blocks, dc->data_blocks,
	       dd_index_bytes(&dc->index) >> 10, dd_hasher_name(&dc->hasher),
	       dc->verify ? ", verify" : "", dc->read_only ? ", read-only" : "");
	return 0;
bad:
	dd_destroy(dc);
	return r;
}

/*
 * The index and the allocation state go to the metadata device, so that
 * the next activation loads them instead of walking every tree. Not when
 * a reloaded table has taken over the metadata already (it is on
 * dd_instances too, and saves when it goes). Until dd_destroy this
 * instance stays on the list, so no other table can claim the devices
 * while the save is written.
 */
static void dd_save_at_close(struct dedup_c *dc)
{
	struct dd_md_saved saved;
	struct dedup_c *other;
	bool successor = false;
	ktime_t start;
	int r;

	mutex_lock(&dd_instances_lock);
	list_for_each_entry(other, &dd_instances, instance)
		successor |= other != dc &&
			     other->meta_dev->bdev == dc->meta_dev->bdev;
	mutex_unlock(&dd_instances_lock);
	if (successor)
		return;
	start = ktime_get();
	dd_index_saved_view(dc, &saved);
	r = dd_md_save(dc->md, &saved);
	if (r == -EROFS)
		return;	/* nothing changed: an earlier save still holds */
	if (r)
		DMWARN("%s: cannot save the index (error %d); the next activation rebuilds it",
		       dd_name(dc), r);
	else
		DMINFO("%s: index of %llu blocks saved for the next activation in %lld ms",
		       dd_name(dc), dc->index.nr_entries,
		       ktime_ms_delta(ktime_get(), start));
}

static void dedup_dtr(struct dm_target *ti)
{
	struct dedup_c *dc = ti->private;

	/* A table never resumed has none; a suspended one drained them. */
	dd_io_drain(dc);
	dd_commit_stop(dc);
	/* dm core destroys a target only when no bio of it is in flight. */
	WARN_ON_ONCE(!dd_cells_empty(&dc->cells));
	if (dc->md && dd_commit(dc))
		DMERR("%s: final commit failed; the device reopens at its last commit",
		      dd_name(dc));
	else if (dc->md)
		dd_save_at_close(dc);
	dd_destroy(dc);
}

static struct target_type dedup_target = {
	.name = "dedup",
	.version = {1, 14, 0},
	.module = THIS_MODULE,
	.ctr = dedup_ctr,
	.dtr = dedup_dtr,
	.map = dedup_map,
	.end_io = dedup_end_io,
	.postsuspend = dedup_postsuspend,
	.preresume = dedup_preresume,
	.resume = dedup_resume,
	.status = dedup_status,
	.message = dedup_message,
	.io_hints = dedup_io_hints,
	.iterate_devices = dedup_iterate_devices,
};

static int __init dm_dedup_init(void)
{
	return dm_register_target(&dedup_target);
}

static void __exit dm_dedup_exit(void)
{
	dm_unregister_target(&dedup_target);
}

module_init(dm_dedup_init);
module_exit(dm_dedup_exit);

MODULE_DESCRIPTION(DM_NAME " target deduplicating 4 KiB blocks inline");
MODULE_LICENSE("GPL");
