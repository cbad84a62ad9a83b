// The element mask of a FlexAttention-style block mask (reference/block_sparse_attention.py's
// ELEMENT_MASKS), compiled in with -DELEMENT_MASK=none, causal, document or sliding_window: the one
// test of whether query `query` sees key `key` inside a partial block (full blocks need none), for
// stage 12's forward and stage 13's backward.
#pragma once

#ifndef ELEMENT_MASK
#define ELEMENT_MASK causal
#endif
namespace element_mask {
enum Kind { none, causal, document, sliding_window };
}
constexpr int MASK = element_mask::ELEMENT_MASK;

// In a partial block: every mask but none is causal (key <= query); the sliding window also hides keys
// `window` or more behind; documents also hide keys of another document (key_doc, query_doc: the
// documents of the key and of the query, document masks only).
__device__ __forceinline__ bool element_visible(int key, int query, int window, int key_doc, int query_doc) {
    if (MASK == element_mask::none) return true;
    bool visible = key <= query;
    if (MASK == element_mask::sliding_window) visible = visible && query - key < window;
    if (MASK == element_mask::document) visible = visible && key_doc == query_doc;
    return visible;
}
