// The embeddings of the store's own files (snapshots and deltas, persistence.cc) read without
// a store: what a quantized export (quantized.cc) is made from. Both readers check a file as
// Load and ApplyDelta check it (structure, row headers, checksum) and leave out the optimizer
// state, which a serving copy does not need.
#ifndef PREFIXREC_INTERNAL_FLOAT_FILES_H_
#define PREFIXREC_INTERNAL_FLOAT_FILES_H_

#include <cstdint>
#include <functional>
#include <string>

#include "prefixrec/embedding_store.h"

namespace prefixrec::internal {

// The largest dim an export file may declare (TrainConfig's tables go to 4096).
constexpr uint32_t kMaxExportDim = 65536;

struct FloatSnapshotInfo {
  uint32_t dim = 0;
  int64_t global_step = 0;
  uint64_t delta_sequence = 0;
};

// Streams the snapshot `dir/store.snapshot`: `on_header` once, then `on_rows(ids, embeddings,
// n)` per block of rows (embeddings n x dim, row-major), in file order. The trailer is verified
// after the last block: a caller commits nothing before this returns.
void ReadSnapshotEmbeddings(const std::string& dir,
                            const std::function<void(const FloatSnapshotInfo&)>& on_header,
                            const std::function<void(const int64_t*, const float*, size_t)>& on_rows);

// The net effect of the delta at `path` (as EmbeddingStore::ReadDelta gives it) without
// checking its sequence or optimizer against a store; `*dim` gets the delta's dim.
EmbeddingStore::DeltaContents ReadDeltaFile(const std::string& path, uint32_t* dim);

}  // namespace prefixrec::internal

#endif  // PREFIXREC_INTERNAL_FLOAT_FILES_H_
