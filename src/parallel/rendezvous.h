// TCP rendezvous: the processes of one parallel group (one per node, or several on one host)
// find each other through node 0 and receive one blob from it (the shared-memory segment
// name for the CPU communicator, the NCCL unique id for NCCL), then pass a barrier.
//
// Protocol (all integers big-endian; every message is a 20-byte header magic, type, a, b,
// payload length, then the payload):
//   node k > 0 connects to master_addr:master_port (retrying while refused, until the
//   deadline) and sends HELLO(a = nnodes, b = node_rank);
//   node 0 listens, accepts nnodes - 1 HELLOs, checks each (same nnodes, rank in range, no
//   duplicate; a mismatch is answered with ERROR(text) and fails node 0 too), then sends
//   BLOB(payload) to every node; then a barrier (BARRIER up, BARRIER down).
// The connections stay open for rendezvous_barrier (used at shutdown and by tests); a peer
// that closes its socket or never answers fails the call with a message naming its rank.
#ifndef ATOMC_PARALLEL_RENDEZVOUS_H
#define ATOMC_PARALLEL_RENDEZVOUS_H

#include <stddef.h>

#include "common/error.h"

struct rendezvous_options {
    int nnodes;              // --nnodes: processes in the group (>= 1)
    int node_rank;           // --node-rank: 0 .. nnodes-1; 0 listens
    const char *master_addr; // --master-addr: host name or address of node 0 (default 127.0.0.1)
    int master_port;         // --master-port: 1 .. 65535
    double timeout_s;        // deadline for the whole join (and for each later barrier)
};

struct rendezvous;

// Joins the group. Node 0 passes blob/blob_len (up to 64 KiB); every node (node 0 included)
// gets a malloc'ed copy in *blob_out (free it) of *blob_out_len bytes.
atomc_status rendezvous_join(const struct rendezvous_options *o, const void *blob, size_t blob_len,
                             struct rendezvous **out, void **blob_out, size_t *blob_out_len, struct error *err);
atomc_status rendezvous_barrier(struct rendezvous *r, struct error *err);
void rendezvous_close(struct rendezvous *r);

#endif
