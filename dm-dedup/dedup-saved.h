/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The in-memory state saved at a clean close (DD_ARRAY_SAVED, see
 * dedup-format.h): written once, after the last commit, and read once, at
 * the next activation, in place of walking every tree. Part of the
 * metadata unit: dedup-metadata.c calls both sides under its own lock.
 */
#ifndef DM_DEDUP_SAVED_H
#define DM_DEDUP_SAVED_H

#include "dedup-block.h"
#include "dedup-metadata.h"

/*
 * Writes the save in the running transaction: the metadata blocks that
 * the last commit's trees use, the data blocks it references (@data), and
 * the target's words. The caller writes the superblock naming *root.
 */
int dd_saved_write(struct dd_bm *bm, const struct dd_space *data,
		   const struct dd_md_saved *saved, void *leaf_buf, u64 *root,
		   u64 *nr_words);

/*
 * Loads a save into the empty allocators (bm->space, @data) and @saved.
 * On failure *why says what did not match, and the allocators and @saved
 * hold partial state that the caller resets.
 */
int dd_saved_load(struct dd_bm *bm, struct dd_space *data, u64 root,
		  u64 nr_words, u64 txn, struct dd_md_saved *saved,
		  const char **why);

#endif
