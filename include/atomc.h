// atomc public C API: an LLM inference engine (paged KV cache, continuous batching).
//
// Usage, synchronous:
//   atomc_engine_options o; atomc_engine_options_init(&o); o.model_path = "...";
//   atomc_engine *e; if (atomc_engine_create(&o, &e, err, sizeof err) != ATOMC_OK) ...
//   atomc_request r; atomc_request_init(&r); r.prompt = "Hello"; r.on_output = cb; ...
//   atomc_engine_add_request(e, &r, &id, err, sizeof err);
//   while (atomc_engine_has_work(e)) atomc_engine_step(e);   // callbacks fire inside step
// or asynchronous: atomc_engine_start(e) runs the loop on its own thread; callbacks then fire
// on that thread. All functions are safe to call from any thread once the engine exists,
// except atomc_engine_step, which must not be called while the loop thread runs.
#ifndef ATOMC_H
#define ATOMC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum atomc_status {
    ATOMC_OK = 0,
    ATOMC_ERR_INVALID_ARGUMENT, // bad option / parameter value
    ATOMC_ERR_IO,               // file missing, unreadable
    ATOMC_ERR_FORMAT,           // corrupt or malformed file
    ATOMC_ERR_UNSUPPORTED,      // valid but not supported (architecture, dtype, feature)
    ATOMC_ERR_OUT_OF_MEMORY,    // host or device memory exhausted
    ATOMC_ERR_TOO_LONG,         // prompt exceeds max_model_len
    ATOMC_ERR_BUSY,             // queue full / overloaded
    ATOMC_ERR_NOT_FOUND,        // unknown request id, tensor, key
    ATOMC_ERR_BACKEND,          // device error (CUDA, ...)
    ATOMC_ERR_INTERNAL,
} atomc_status;

const char *atomc_status_name(atomc_status s);

typedef enum atomc_finish_reason {
    ATOMC_FINISH_NONE = 0, // still running
    ATOMC_FINISH_STOP,     // EOS, stop token or stop string
    ATOMC_FINISH_LENGTH,   // max_tokens or end of context
    ATOMC_FINISH_ABORT,    // aborted by the caller (or client disconnect)
    ATOMC_FINISH_ERROR,    // failed (message in atomc_output.error)
} atomc_finish_reason;

const char *atomc_finish_reason_name(atomc_finish_reason r); // "stop", "length", "abort", "error"

typedef struct atomc_engine_options {
    const char *model_path;        // HF model directory, or a .gguf file
    const char *device;            // "cpu" (NULL), "cuda", or "auto" (CUDA when a usable GPU and the CUDA
                                   // backend are there, else CPU; the CLI's default)
    const char *dtype;             // "auto" (default), "bfloat16", "float16", "float32"
    const char *load_format;       // "auto" (default) or "dummy" (random weights from config.json)
    const char *quantization;      // NULL / "none" (default): as the checkpoint is; "fp8": vLLM's online fp8
                                   // (per-channel FP8 weights, dynamic per-token FP8 activations) of an
                                   // unquantized checkpoint
    const char *kv_cache_dtype;    // "auto" (default), "bf16", "fp8"
    const char *generation_config; // "auto" (default: read generation_config.json) or "vllm" (ignore it)
    int max_model_len;             // 0 = the model's own limit
    int max_num_seqs;              // 0 = auto: 256 (cuda), 16 (cpu)
    int max_num_batched_tokens;    // 0 = auto: 8192 (cuda; 16384 when offline), 2048 (cpu); at least max_num_seqs
    int long_prefill_token_threshold; // most tokens one prompt's prefill chunk takes per step, so requests that
                                      // arrive under a long prompt are admitted and decode between its chunks
                                      // (vLLM's option; scheduler.h); 0 = no cap (a chunk may take the whole
                                      // budget); -1 (the default) = auto: 512 on the CPU, no cap on CUDA
                                      // (a whole-budget step is short there) and when offline
    int block_size;                // KV tokens per block, default 16
    int num_kv_blocks;             // 0 = sized automatically
    double gpu_memory_utilization; // default 0.9
    size_t cpu_kv_cache_bytes;     // CPU backend KV pool size; 0 = 512 MiB or what max_model_len needs
    bool enable_prefix_caching;    // default true
    bool enforce_eager;            // CUDA: no graphs
    int num_threads;               // CPU threads, 0 = number of cores
    bool cpu_exact_kernels;        // CPU: quantized weights decode through the bit-exact kernels
                                   // (--cpu-exact-kernels; default: the faster int16-activation ones)
    int grammar_threads;           // structured output: threads that fill the grammar masks of a step's
                                   // constrained rows in parallel (--grammar-threads); 0 = auto: online cores
                                   // minus the CPU backend's threads (CUDA: minus one, the engine's own),
                                   // at least 1, at most 64
    uint64_t seed;                 // default seed for requests without one
    int tensor_parallel_size;      // default 1
    int max_waiting;               // bounded waiting queue (ATOMC_ERR_BUSY past it); 0 = unbounded
    const char *profile_dir;       // enables atomc_engine_start_profile / stop_profile (Chrome traces written here)
    bool offline;                  // batch use, every request known up front (bench throughput): vLLM's
                                   // offline defaults (larger prefill chunks on CUDA)
    bool moe_uniform_routing;      // BENCHMARK ONLY (the bench commands' --moe-uniform-routing): MoE
                                   // routing replaced by a balanced round-robin over the experts

    // Speculative decoding (vLLM's --speculative-config; docs/ARCHITECTURE.md "Speculative
    // decoding"). NULL / "" = off; "ngram" = prompt lookup over the sequence's own tokens.
    const char *speculative_method;
    const char *speculative_model;         // "eagle3": the EAGLE-3 head directory (vLLM's "model" key); else NULL
    int num_speculative_tokens;            // k: draft tokens verified per step (1..ATOMC_MAX_SPEC_TOKENS)
    int prompt_lookup_min;                 // ngram: shortest suffix matched (0 = vLLM's default: 5, or max if given)
    int prompt_lookup_max;                 // ngram: longest suffix matched (0 = vLLM's default: 5, or min if given)
    int speculative_disable_by_batch_size; // drafts off in a step with more decoding sequences than this;
                                           // 0 = auto (cpu 8, cuda 32), -1 = never off
    double spec_forced_acceptance; // BENCHMARK ONLY (bench throughput --spec-forced-acceptance F): in (0, 1], every
                                   // decode carries k drafts (its last token repeated) and each is accepted with
                                   // probability F (a chain: the first rejection ends it) whatever the model says,
                                   // so the verify path can be timed on random weights; outputs are not the model's

    // Prefill/decode disaggregation (docs/ARCHITECTURE.md "Prefill/decode disaggregation"):
    // vLLM's --kv-transfer-config JSON ({"kv_connector": "tcp"|"cuda_ipc", "kv_role":
    // "kv_producer"|"kv_consumer"|"kv_both", "kv_ip", "kv_port", "kv_connector_extra_config"}).
    // NULL / "" = off.
    const char *kv_transfer_config;

    // Hybrid sliding / full models (GPT-OSS, MiMo-V2-Flash, Qwen3 with max_window_layers): by
    // default the sliding-window layers keep their KV in a pool of their own with a block table
    // per sequence, whose out-of-window blocks are freed while the sequence runs (per-layer-group
    // block tables, docs/ARCHITECTURE.md "Engine"). true = one table for every layer, all blocks
    // kept (vLLM's --disable-hybrid-kv-cache-manager). Also off with KV transfer or tensor parallelism.
    bool disable_hybrid_kv_cache_manager;
} atomc_engine_options;

#define ATOMC_MAX_SPEC_TOKENS 16

void atomc_engine_options_init(atomc_engine_options *o);

// Structured output grammars (atomc_sampling_params.grammar_kind).
typedef enum atomc_grammar_kind {
    ATOMC_GRAMMAR_NONE = 0,
    ATOMC_GRAMMAR_JSON_SCHEMA,    // a JSON Schema document
    ATOMC_GRAMMAR_JSON_OBJECT,    // any JSON object (grammar text unused)
    ATOMC_GRAMMAR_REGEX,          // a regular expression the whole output matches
    ATOMC_GRAMMAR_CHOICE,         // a JSON array of strings: the output is exactly one of them
    ATOMC_GRAMMAR_EBNF,           // GBNF-style EBNF whose start rule is "root"
    ATOMC_GRAMMAR_LARK,           // a Lark grammar whose start rule is "start"
    ATOMC_GRAMMAR_STRUCTURAL_TAG, // xgrammar's structural-tag JSON
} atomc_grammar_kind;

typedef struct atomc_sampling_params {
    float temperature;        // default 1.0; 0 = greedy
    float top_p;              // default 1.0
    int top_k;                // default 0 (= off; -1 also off)
    float min_p;              // default 0
    float presence_penalty;   // default 0
    float frequency_penalty;  // default 0
    float repetition_penalty; // default 1.0
    bool has_seed;
    uint64_t seed;
    int max_tokens;           // default 16; -1 = up to the context
    int min_tokens;           // default 0
    bool ignore_eos;
    const char *const *stop; // stop strings (copied by the engine)
    int n_stop;
    const int32_t *stop_token_ids; // copied by the engine
    int n_stop_token_ids;
    bool include_stop_str_in_output;
    bool skip_special_tokens; // default true
    int logprobs;             // -1 = none; k >= 0: chosen-token logprob + top-k alternatives
    int prompt_logprobs;      // -1 = none; k >= 0: per prompt token (echo + logprobs)
    bool no_speculation;      // this request never gets draft tokens (output is the same either way)
    // Structured output: the output must match this grammar (compiled against the tokenizer's
    // vocabulary when the request is added, cached by (kind, text); an invalid one is
    // ATOMC_ERR_INVALID_ARGUMENT naming the problem). Tokens the grammar does not allow next get
    // -inf logits before penalties / temperature / filtering; EOS is allowed only where the
    // grammar may end; a grammar that has ended finishes the request with "stop". Constrained
    // requests get no speculative drafts. The text is copied.
    atomc_grammar_kind grammar_kind; // default ATOMC_GRAMMAR_NONE
    const char *grammar;             // the schema / regex / choice JSON array / EBNF / Lark text
    size_t grammar_len;              // 0 = strlen(grammar)
    // Hook for reasoning models: -1 (default) = the grammar applies from the first output token;
    // otherwise output is free until this token id (e.g. "</think>") has been generated, and the
    // grammar applies to the tokens after it.
    int32_t grammar_start_token;
} atomc_sampling_params;

void atomc_sampling_params_init(atomc_sampling_params *p);

typedef struct atomc_top_logprob {
    int32_t token;
    float logprob;
} atomc_top_logprob;

// One token's logprob information (for the sampled token, or a prompt token).
typedef struct atomc_token_logprobs {
    int32_t token;
    float logprob;
    int n_top;
    const atomc_top_logprob *top; // n_top entries, best first
} atomc_token_logprobs;

// Delivered to a request's callback after each engine step that produced something for it.
// Pointers are valid only during the callback.
typedef struct atomc_output {
    uint64_t request_id;
    const int32_t *new_tokens; // tokens generated this step
    int n_new_tokens;
    const char *text;          // detokenized text delta (never a broken UTF-8 sequence)
    size_t text_len;
    const atomc_token_logprobs *logprobs;        // n_new_tokens entries, or NULL
    // Only in the first output: entry i is prompt token i + 1 (the first prompt token has no
    // logprob; n_prompt_logprobs = prompt_tokens - 1). Requests asking for prompt logprobs
    // bypass the prefix cache (every prompt row must be computed).
    const atomc_token_logprobs *prompt_logprobs;
    int n_prompt_logprobs;
    atomc_finish_reason finish_reason;
    const char *stop_str;      // the stop string matched, if finished by one
    int32_t stop_token;        // the stop token matched, or -1
    int prompt_tokens;
    int completion_tokens;
    int cached_tokens;         // prompt tokens served from the prefix cache
    const char *error;         // when finish_reason == ATOMC_FINISH_ERROR

    // Request timing for metrics, in seconds of one monotonic clock (0 = not yet). TTFT =
    // first_token_time - arrival_time; queue time = first_scheduled_time - arrival_time;
    // inter-token latency = difference of last_token_time between outputs; e2e latency =
    // finish_time - arrival_time (finish_time is set in the final output only).
    double arrival_time;
    double first_scheduled_time;
    double first_token_time;
    double last_token_time;    // time the newest token of this output was produced
    double finish_time;
    int num_preemptions;       // times this request was preempted (and recomputed)
    // KV transfer: seconds from the first to the last KV frame of this prompt on the consumer
    // (0 = none); kv_fallback: a remote prefill was asked for but the prompt was computed here.
    double kv_transfer_s;
    bool kv_fallback;
} atomc_output;

typedef void (*atomc_output_fn)(void *user, const atomc_output *out);

typedef struct atomc_request {
    const char *prompt;          // UTF-8 text, or NULL if prompt_ids is given
    size_t prompt_len;           // 0 = strlen(prompt)
    const int32_t *prompt_ids;   // token ids (copied)
    int n_prompt_ids;
    bool add_special_tokens;     // add BOS etc. when tokenizing `prompt`; default true
    atomc_sampling_params params;
    atomc_output_fn on_output;   // may be NULL (then use atomc_engine_generate)
    void *user;

    // KV transfer (vLLM's request-level kv_transfer_params; needs options.kv_transfer_config).
    // kv_transfer_id: the key both instances know the transfer by (copied). Producer:
    // kv_do_remote_decode sends this prompt's KV, as it is computed, to the consumer
    // kv_remote_engine_id (NULL: the only connected one) and holds the blocks until it
    // acknowledges. Consumer: kv_do_remote_prefill takes the prompt's KV from producer
    // kv_remote_engine_id and computes only the last prompt token; if the KV does not arrive
    // within the connector's timeout (or the transfer breaks) the prompt is prefilled locally.
    const char *kv_transfer_id;
    const char *kv_remote_engine_id;
    bool kv_do_remote_decode;
    bool kv_do_remote_prefill;
} atomc_request;

void atomc_request_init(atomc_request *r);

typedef struct atomc_engine atomc_engine;

// Loads the model and allocates the KV pool. On failure writes a message to err.
atomc_status atomc_engine_create(const atomc_engine_options *o, atomc_engine **out, char *err, size_t err_len);
void atomc_engine_free(atomc_engine *e); // stops the loop thread if running; aborts all requests

// Admits a request; *out_id receives its id. Rejects prompts longer than max_model_len
// (ATOMC_ERR_TOO_LONG, message naming both numbers), invalid token ids, bad parameters.
atomc_status atomc_engine_add_request(atomc_engine *e, const atomc_request *r, uint64_t *out_id, char *err,
                                      size_t err_len);
// Aborts a request wherever it is; its KV blocks are freed at the next step. Its callback
// receives a final output with ATOMC_FINISH_ABORT. Unknown ids return ATOMC_ERR_NOT_FOUND.
atomc_status atomc_engine_abort(atomc_engine *e, uint64_t id);

// Runs one scheduler step + forward + sampling; fires callbacks. Returns the number of
// sequences processed (0 when idle).
//
// Callbacks fire on the thread that runs the step (the loop thread once started), without
// any engine lock held: a callback may call atomc_engine_add_request / atomc_engine_abort,
// but must not block for long (it stalls the whole batch). Every request gets exactly one
// final output (finish_reason != ATOMC_FINISH_NONE), after which its id is unknown. Each
// output with text carries new text only: the stop-string rule holds back text that may
// be the start of a stop string until it is decided, so a delta can be empty.
// Stop rules (vLLM's): EOS (config + generation_config + tokenizer, unless ignore_eos),
// stop_token_ids and stop strings end a request with "stop", none of them before
// min_tokens output tokens (EOS and stop ids are also banned in sampling until then);
// max_tokens or the end of the context (max_model_len) end it with "length". A stop token
// is counted in completion_tokens and listed in new_tokens, its text is not output; a stop
// string's text is cut from the output unless include_stop_str_in_output.
int atomc_engine_step(atomc_engine *e);
bool atomc_engine_has_work(atomc_engine *e);

// Background loop thread.
atomc_status atomc_engine_start(atomc_engine *e);
void atomc_engine_stop(atomc_engine *e);

// Per-step timeline profiling (needs options.profile_dir): start clears and records the spans of
// every step (propose (speculative drafts), schedule, prepare_inputs, execute, postprocess,
// detokenize); stop writes them as Chrome trace JSON to profile_dir/atomc-trace-<pid>-<n>.json
// and returns that path in path_out.
// In CUDA builds the same spans are NVTX ranges (Nsight Systems), recorded or not.
atomc_status atomc_engine_start_profile(atomc_engine *e, char *err, size_t err_len);
atomc_status atomc_engine_stop_profile(atomc_engine *e, char *path_out, size_t path_len, char *err, size_t err_len);

// Blocking batch generation (runs the loop itself if no thread is running). The requests'
// on_output / user fields are ignored. If one request is rejected, none runs: the error is
// returned for it (err names its index).
typedef struct atomc_result {
    int32_t *tokens; // owned; free with atomc_result_free
    int n_tokens;
    char *text;      // owned
    atomc_finish_reason finish_reason;
    int prompt_tokens;
    int cached_tokens;
} atomc_result;
atomc_status atomc_engine_generate(atomc_engine *e, const atomc_request *reqs, int n, atomc_result *results,
                                   char *err, size_t err_len);
void atomc_result_free(atomc_result *r);

typedef struct atomc_stats {
    int num_running;
    int num_waiting;
    int num_kv_blocks;
    int num_free_kv_blocks;
    double kv_cache_usage;        // 0..1
    uint64_t prefix_cache_queries; // tokens looked up
    uint64_t prefix_cache_hits;    // tokens found
    uint64_t num_preemptions;
    uint64_t prompt_tokens_total;
    uint64_t generation_tokens_total;
    uint64_t num_steps;
    uint64_t num_requests_finished; // finished with any reason, including aborts
    uint64_t num_requests_aborted;
    uint64_t prefix_cache_evictions; // cached blocks reused for other content

    // Speculative decoding (vLLM's spec_decode counters): drafts = sequence-steps verified with at
    // least one draft token; draft tokens proposed and verified; of those, accepted; accepted at
    // draft position i (0-based). Mean acceptance length = 1 + accepted / drafts.
    int num_speculative_tokens; // k of the engine (0 = off)
    uint64_t spec_num_drafts;
    uint64_t spec_num_draft_tokens;
    uint64_t spec_num_accepted_tokens;
    uint64_t spec_accepted_per_pos[ATOMC_MAX_SPEC_TOKENS];

    // Prompt tokens the model actually computed (prefix-cache hits and transferred KV excluded;
    // a preempted sequence's recompute counts again).
    uint64_t prompt_tokens_computed;
    // KV transfer (0 without kv_transfer_config): KV payload bytes and blocks of completed
    // transfers sent (producer) / received (consumer), transfers failed or refused, consumer
    // requests that fell back to a local prefill, blocks the producer holds for unacknowledged
    // transfers, consumer requests waiting for their KV.
    int kv_role; // 0 none, 1 producer, 2 consumer, 3 both
    uint64_t kv_bytes_sent, kv_bytes_received, kv_blocks_sent, kv_blocks_received;
    uint64_t kv_transfers_sent, kv_transfers_received, kv_transfers_failed, kv_fallbacks;
    int kv_held_blocks, kv_waiting;
    int kv_peers; // KV connections past the handshake

    // Per-layer-group block tables (hybrid sliding / full models; 0 otherwise): the sliding-window
    // layers' pool, its free blocks, and the most blocks of each pool in use at once so far
    // (num_kv_blocks / num_free_kv_blocks are then the full-attention layers' pool).
    int num_kv_blocks_sw;
    int num_free_kv_blocks_sw;
    int peak_kv_blocks_used, peak_kv_blocks_used_sw;
    // Producer: DATA frames (one layer of one transfer's step) queued in all and while the forward
    // still ran (per-layer sends); the largest send queue of one consumer connection (bytes) and
    // the times a full queue made the producer wait (back-pressure).
    uint64_t kv_layers_sent, kv_layers_during_forward, kv_send_queue_peak, kv_send_queue_waits;
    // Prompt blocks the consumer already had in its prefix cache, so the producer did not send
    // them (producer: skipped on sends; consumer: reused on claims).
    uint64_t kv_blocks_skipped;
} atomc_stats;
void atomc_engine_get_stats(atomc_engine *e, atomc_stats *s);

// The KV transfer identity of the engine (kv_transfer_config): role (0 none, 1 producer, 2
// consumer, 3 both), engine id, and the producer's listening address. Strings live as long as
// the engine.
typedef struct atomc_kv_info {
    int role;
    const char *engine_id;
    const char *host;
    int port;
} atomc_kv_info;
void atomc_engine_get_kv_info(atomc_engine *e, atomc_kv_info *out);

typedef struct atomc_model_info {
    const char *architecture; // e.g. "LlamaForCausalLM"
    const char *model_name;   // basename of the path
    int max_model_len;
    int vocab_size;
    int block_size;
    const char *chat_template; // NULL if the model has none
    const char *bos_token;     // text of BOS / EOS, or NULL
    const char *eos_token;

    // Sampling defaults from the model's generation_config.json (vLLM applies them to
    // requests that leave the field unset, unless generation_config is "vllm"). Fields not
    // given: temperature/min_p -1, top_p/repetition_penalty 0, top_k -1, max_tokens 0.
    bool has_generation_defaults;
    float default_temperature;
    float default_top_p;
    int default_top_k;
    float default_min_p;
    float default_repetition_penalty;
    int default_max_tokens;    // max_new_tokens
} atomc_model_info;
void atomc_engine_get_model_info(atomc_engine *e, atomc_model_info *info);

// Tokenizer access (thread-safe, independent of the loop).
atomc_status atomc_engine_tokenize(atomc_engine *e, const char *text, size_t len, bool add_special_tokens,
                                   int32_t **ids, int *n_ids);
atomc_status atomc_engine_detokenize(atomc_engine *e, const int32_t *ids, int n_ids, bool skip_special_tokens,
                                     char **text);
// Raw bytes of one token as it appears in decoded text (byte-level pieces mapped back to bytes;
// may be a partial UTF-8 sequence), for logprob "bytes" fields. NULL if the id is invalid or the
// engine has no tokenizer. Valid as long as the engine.
const char *atomc_engine_token_bytes(atomc_engine *e, int32_t id, size_t *len);
void atomc_free(void *p);

#ifdef __cplusplus
}
#endif
#endif
