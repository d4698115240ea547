// KV transfer between engine instances (prefill/decode disaggregation, issue 24).
//
// Roles. A *producer* (prefill instance) computes a prompt's KV and ships it; a *consumer*
// (decode instance) receives it, puts it into its own paged pool and decodes. kv_both does both.
// The producer given kv_ip / kv_port listens there; a consumer given the same address connects
// (and keeps reconnecting); one connection carries the control frames and, for the `tcp`
// connector, the KV bytes.
//
// Handshake (first frame each way): engine id, model name, architecture, a hash of the model
// config, KV dtype, block size, layer count, the per-layer KV bytes of one token and of one
// block, the tensor-parallel layout. Any mismatch closes the connection with a message naming
// the field on both sides (kv_handshake_check).
//
// Per request (transfer_id = the string both HTTP requests carry in kv_transfer_params):
//   QUERY  producer -> consumer, before the producer computes the prompt: its token ids
//   HAVE   consumer -> producer: how many leading full blocks of that prompt its prefix cache
//          holds (block_manager_lookup: chained hashes and token ids); the producer sends only
//          the rest. No answer within query_timeout_s: the producer sends everything.
//   BEGIN  transfer id, prompt token ids, the chained block hashes of its full blocks
//          (block_manager.h's XXH64 chain), the producer's block ids, token count, and the
//          number of leading tokens it will not send (skip = HAVE's blocks x block size)
//   DATA   one per layer per engine step: (layer, tok0, n_tok) and the K rows of those tokens
//          then their V rows, in the pool's element layout (`tcp` only); any subset of layers
//          and token ranges in any order: the consumer places each at (layer, tok0) and the
//          transfer is complete when END arrives with every byte of every layer received
//   END    the prompt's KV is complete; repeats the producer's block ids (final after chunked prefill)
//   ACK    consumer -> producer: the consumer has the KV (or gave up on it); the producer then
//          releases the blocks it held for this transfer
//   ABORT  producer -> consumer: the transfer will not complete (request aborted / failed)
// Granularity: per layer, inside the forward. Before a step that computes prompt tokens of
// producer sequences the engine registers each one's token range (kv_connector_step_add; BEGIN
// goes out with the first); the forward calls kv_connector_layer_ready after every layer's KV
// write (the runner's per-layer hook; on CUDA with the event recorded on the compute stream right
// after that write); the connector's copy thread waits for the event, reads that layer's rows
// (CUDA: on the backend's side stream) into a DATA frame and queues it while later layers compute;
// kv_connector_step_end (after the forward) waits for the remaining layers and queues END for
// prompts that are complete. The engine's step ends only when the step's rows are read, so no
// block is freed or reused while a copy reads it. Decode steps register nothing, so they run as
// CUDA graphs (a batch with a hook never replays a graph, and graphs are captured without one).
//
// Send queue: per consumer connection, frames not yet written to the socket count against
// send_queue_bytes; the copy thread waits (back-pressure: the producer's step, hence its
// scheduler, waits) until the queue drains below the cap, and a consumer that reads nothing for
// send_timeout_s is disconnected (its transfers fail over to local prefill on its side).
//
// Consumer side: frames are assembled in a host staging buffer per transfer (the decode request
// usually arrives after the KV, since the proxy asks the prefill instance first); when the
// engine admits the request it takes its cached prefix (the skipped blocks; if they were
// evicted meanwhile it prefills locally), allocates the other blocks and `claim` copies the
// staged rows [skip, n) into them.
//
// Connectors: `tcp` (KV bytes in DATA frames) and `cuda_ipc` (same host: HELLO carries the
// producer pool's cudaIpcMemHandle; no DATA frames; `claim` maps the producer's pool once and
// cudaMemcpy's the producer's blocks, named in BEGIN, into the consumer's blocks). An RDMA
// connector (UCX / NIXL) fits the same split: HELLO carries the registered pool's rkey / NIXL
// agent metadata, BEGIN the producer's block ids, `claim` posts RDMA READs of those blocks
// (the producer holds them until ACK, as it already does).
//
// Threads: one I/O thread per connector (poll() over the listener, the peers and a wake pipe);
// every function below may be called from any thread (one mutex inside).
#ifndef ATOMC_KV_TRANSFER_KV_CONNECTOR_H
#define ATOMC_KV_TRANSFER_KV_CONNECTOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

#define KV_ID_MAX 96 // transfer ids and engine ids (incl. NUL)
#define KV_MAX_PEERS 32
#define KV_MAX_PRODUCERS 8
#define KV_PROTOCOL_VERSION 2 // 2: QUERY / HAVE, BEGIN's skip

enum kv_role { KV_ROLE_NONE = 0, KV_ROLE_PRODUCER = 1, KV_ROLE_CONSUMER = 2, KV_ROLE_BOTH = 3 };
enum kv_connector_kind { KV_CONNECTOR_TCP = 0, KV_CONNECTOR_CUDA_IPC };

// vLLM's --kv-transfer-config JSON: {"kv_connector": "tcp"|"cuda_ipc" (default tcp; vLLM's
// connector names are refused with a message), "kv_role": "kv_producer"|"kv_consumer"|"kv_both",
// "kv_ip" (default 127.0.0.1), "kv_port" (default 14579), "kv_connector_extra_config": {
// "engine_id": str, "timeout_s": consumer wait for KV before prefilling locally (default 10),
// "hold_timeout_s": producer hold of unacknowledged blocks (default 60),
// "send_queue_bytes": cap of unsent bytes queued per consumer connection (default 64 MiB),
// "send_timeout_s": a full send queue that does not drain for this long drops the consumer (30),
// "query_timeout_s": producer wait for the consumer's HAVE before computing a prompt (0.5),
// "producers": ["host:port", ...] (a consumer of several producers; default [kv_ip:kv_port])}}.
struct kv_transfer_config {
    enum kv_connector_kind kind;
    enum kv_role role;
    char ip[64];
    int port;
    char engine_id[KV_ID_MAX];
    double timeout_s, hold_timeout_s, send_timeout_s, query_timeout_s;
    uint64_t send_queue_bytes;
    int n_producers;
    char producers[KV_MAX_PRODUCERS][96]; // "host:port"
};

// Parses json (a JSON object) into c. Unknown keys, bad types and bad values are errors naming
// the key.
atomc_status kv_transfer_config_parse(const char *json, struct kv_transfer_config *c, struct error *err);
const char *kv_role_name(enum kv_role r); // "kv_producer", ...

// What both sides of a connection must agree on (sent in HELLO).
struct kv_handshake {
    uint32_t version;
    int32_t role;
    char engine_id[KV_ID_MAX];
    char model[128];
    char architecture[64];
    uint64_t config_hash;
    int32_t kv_dtype; // enum dtype
    int32_t block_size, n_layers, tp_size, tp_rank;
    uint64_t token_bytes;      // KV bytes of one token over all layers
    uint64_t layer_bytes_hash; // XXH64 over the per-layer (K row, V row) byte sizes
};

// ATOMC_OK when the two can exchange KV; else ATOMC_ERR_UNSUPPORTED naming the first field
// that differs (both values).
atomc_status kv_handshake_check(const struct kv_handshake *mine, const struct kv_handshake *peer, struct error *err);

// The runner's KV pool as a connector sees it (filled by the model runner).
struct kv_pool_view {
    int n_layers, block_size, num_blocks, kv_dtype;
    const size_t *k_row_bytes, *v_row_bytes; // (n_layers) bytes of one token's K / V in layer l
    // Copies the rows of tokens [tok0, tok0 + n_tok) of the sequence whose blocks are block_ids
    // (position order) between the pool and host: host = K rows then V rows of layer `layer`.
    void *ctx;
    // Pool -> host copies run on the connector's copy thread while the engine computes later
    // layers (rows of earlier layers are not written again by the step).
    atomc_status (*copy)(void *ctx, int layer, const int32_t *block_ids, int tok0, int n_tok, void *host, bool to_pool,
                         struct error *err);
    // Blocks the calling thread until the event of kv_connector_layer_ready has passed (NULL:
    // no events, the rows are written when layer_ready is called).
    void (*wait)(void *ctx, void *event);
    // Device pools (cuda_ipc): the allocation, its device and each layer's K / V byte offset.
    void *base;
    size_t bytes;
    bool on_device;
    int device;
    const size_t *k_offset, *v_offset; // (n_layers)
};

size_t kv_pool_token_bytes(const struct kv_pool_view *p); // sum over layers of K + V row bytes

// --- framing (exposed for the unit tests) -----------------------------------------------------
enum kv_frame_type {
    KV_FRAME_HELLO = 1,
    KV_FRAME_HELLO_OK,
    KV_FRAME_HELLO_ERR,
    KV_FRAME_BEGIN,
    KV_FRAME_DATA,
    KV_FRAME_END,
    KV_FRAME_ACK,
    KV_FRAME_ABORT,
    KV_FRAME_QUERY,
    KV_FRAME_HAVE
};
#define KV_FRAME_MAGIC 0x31564b41u // "AKV1"
#define KV_FRAME_HEADER 12         // magic u32, type u16, id_len u16, body_len u32 (little-endian host order)
#define KV_FRAME_MAX_BODY ((uint64_t)1 << 31)

struct kv_frame {
    enum kv_frame_type type;
    char id[KV_ID_MAX];
    const uint8_t *body; // points into the parsed buffer
    size_t body_len;
};

// Parses one frame at the start of buf[0..len). Returns the frame's total length (> 0), 0 when
// more bytes are needed (a partial read), or -1 with err set for a malformed frame (bad magic,
// unknown type, id too long, body over KV_FRAME_MAX_BODY).
long kv_frame_parse(const uint8_t *buf, size_t len, struct kv_frame *f, struct error *err);
// Writes a frame header + id into out (KV_FRAME_HEADER + strlen(id) bytes); body_len bytes follow.
size_t kv_frame_header(uint8_t *out, enum kv_frame_type type, const char *id, size_t body_len);

// --- the connector ----------------------------------------------------------------------------
struct kv_connector;

struct kv_connector_stats {
    uint64_t bytes_sent, bytes_received;         // KV payload bytes (DATA bodies, or IPC copies)
    uint64_t blocks_sent, blocks_received;       // blocks of completed transfers
    uint64_t transfers_sent, transfers_received; // completed (END sent / claimed)
    uint64_t transfers_failed;                   // aborted, broken or refused
    // Producer pipelining: DATA frames (one layer of one transfer) queued while the forward still
    // ran (before kv_connector_step_end was called) and in all.
    uint64_t layers_during_forward, layers_sent;
    uint64_t layers_received; // consumer: DATA frames placed into staging buffers
    // Send queue: unsent bytes queued now (all connections), the largest it was on one
    // connection, and the times the copy thread waited for a full queue to drain.
    uint64_t send_queue_bytes, send_queue_peak, send_queue_waits;
    uint64_t blocks_skipped; // leading blocks the consumer had cached: not sent / not copied
    int peers;                                   // connections past the handshake now
    char last_error[ERROR_MSG_MAX];              // last handshake / connection error ("" = none)
};

// Creates the connector (starts listening / connecting on its I/O thread). wake(wake_arg) is
// called from the I/O thread whenever an ACK or a completed transfer arrives (NULL: none).
atomc_status kv_connector_create(const struct kv_transfer_config *cfg, const struct kv_handshake *hs,
                                 const struct kv_pool_view *pool, void (*wake)(void *), void *wake_arg,
                                 struct kv_connector **out, struct error *err);
void kv_connector_free(struct kv_connector *c);
void kv_connector_get_stats(struct kv_connector *c, struct kv_connector_stats *s);

// Producer: one call per engine step that computed prompt tokens [tok0, tok0 + n_tok) of the
// transfer (first: the first call, sends BEGIN; last: the prompt is complete, sends END).
// tokens / n_tokens: the whole prompt; block_ids: its blocks. remote_engine_id names the
// consumer (NULL / "": the only connected consumer). An error (no such consumer, connection
// gone) means the transfer is off: the caller stops sending and frees its blocks.
struct kv_send {
    const char *transfer_id, *remote_engine_id;
    const int32_t *tokens;
    int n_tokens;
    const uint64_t *block_hashes; // (n_tokens / block_size) chained hashes of the full blocks
    const int32_t *block_ids;     // (ceil(n_tokens / block_size))
    int tok0, n_tok;
    bool first, last;
    int skip; // leading prompt tokens the consumer has cached (HAVE): never sent; tok0 >= skip
};
// kv_connector_step_add for one send, every layer ready, kv_connector_step_end: the whole
// range at once (models without the per-layer hook, tests).
atomc_status kv_connector_send(struct kv_connector *c, const struct kv_send *s, struct error *err);
// Per-layer sends of one forward step (engine thread; one step at a time):
// step_add registers s (its arrays are copied) for the coming forward, queues BEGIN when
// s->first; an error means the transfer is off (nothing registered). layer_ready(layer, event):
// layer's KV rows of the step are written (event: see kv_pool_view.wait); layers in order.
// step_end(ok): ok = the forward succeeded: waits until every layer of every registered send is
// queued (layers never reported are read now), queues END for the sends with `last`; failed[i]
// (i in step_add order, may be NULL) tells which sends lost their consumer during the step.
// !ok: the registered sends are dropped (the caller aborts them). Returns the sends registered.
atomc_status kv_connector_step_add(struct kv_connector *c, const struct kv_send *s, struct error *err);
void kv_connector_layer_ready(struct kv_connector *c, int layer, void *event);
int kv_connector_step_end(struct kv_connector *c, bool ok, bool *failed, int n_failed);
void kv_connector_send_abort(struct kv_connector *c, const char *transfer_id);
// Asks the consumer (remote_engine_id, NULL / "": the only one) how much of the prompt it has
// cached (QUERY); the answer is read with kv_connector_take_have. An error: no such consumer.
atomc_status kv_connector_query(struct kv_connector *c, const char *transfer_id, const char *remote_engine_id,
                                const int32_t *tokens, int n_tokens, struct error *err);
// The consumer's HAVE for transfer_id: leading full blocks it has (>= 0; the answer is then
// forgotten), or -1 when none came yet (or the consumer's connection is gone: -2).
int kv_connector_take_have(struct kv_connector *c, const char *transfer_id);
// Calls fn for each transfer the consumer acknowledged (or whose consumer connection died)
// since the last call.
void kv_connector_poll_acks(struct kv_connector *c, void (*fn)(void *u, const char *transfer_id), void *u);

// Consumer: answers the QUERYs that arrived since the last call; fn returns how many leading
// full blocks of tokens the engine's prefix cache holds (engine thread: the block manager).
void kv_connector_answer_queries(struct kv_connector *c, int (*fn)(void *u, const int32_t *tokens, int n_tokens),
                                 void *u);

// Consumer.
enum kv_rx_state { KV_RX_UNKNOWN = 0, KV_RX_PENDING, KV_RX_READY, KV_RX_FAILED };
struct kv_rx_info {
    int n_tokens;
    const int32_t *tokens;        // valid until claim / drop of this transfer
    const uint64_t *block_hashes; // (n_tokens / block_size)
    int skip;                     // leading tokens not sent: the consumer must have them cached
    double t_begin, t_end;        // monotonic seconds BEGIN / END arrived
};
// State of transfer_id. UNKNOWN also means "nothing yet"; when remote_engine_id is given and
// no connection to that producer is up, an unknown transfer is FAILED (it cannot arrive).
enum kv_rx_state kv_connector_lookup(struct kv_connector *c, const char *transfer_id, const char *remote_engine_id,
                                     struct kv_rx_info *info);
// Copies a READY transfer's KV (tokens [skip, n_tokens)) into block_ids (position order,
// enough blocks for n_tokens; the first skip / block_size are the consumer's cached prefix and
// are not written), acknowledges it and forgets it.
atomc_status kv_connector_claim(struct kv_connector *c, const char *transfer_id, const int32_t *block_ids, int n_blocks,
                                struct error *err);
// Forgets transfer_id (fallback, abort) and acknowledges it so the producer frees its blocks;
// unknown ids are remembered briefly so late frames are dropped.
void kv_connector_drop(struct kv_connector *c, const char *transfer_id);

// cuda_ipc helpers (kv_cuda_ipc.c; CUDA builds, else UNSUPPORTED): export the pool's IPC handle
// (64 bytes), open a peer's, copy blocks from a peer's pool into ours.
#define KV_IPC_HANDLE_BYTES 64
atomc_status kv_ipc_export(const struct kv_pool_view *pool, uint8_t handle[KV_IPC_HANDLE_BYTES], struct error *err);
atomc_status kv_ipc_open(const uint8_t handle[KV_IPC_HANDLE_BYTES], int device, void **remote_base, struct error *err);
void kv_ipc_close(void *remote_base);
// For every layer: the first n_tokens token rows of src_blocks (in the peer pool at remote_base,
// same layout as ours) to dst_blocks of pool. Returns the bytes copied in *bytes.
atomc_status kv_ipc_copy(const struct kv_pool_view *pool, void *remote_base, const int32_t *src_blocks,
                         const int32_t *dst_blocks, int n_tokens, size_t *bytes, struct error *err);

#endif
