// Work off the event-loop thread (issue 28 item 2). Parsing a large JSON body, rendering its chat
// messages and tokenizing its prompt took seconds on the loop thread for a 30 MB body, stalling
// every stream. Requests whose body is at least SERVER_OFFLOAD_BYTES go to a small pool of worker
// threads instead: the body is moved out of the request (no copy), a worker runs the pure part
// (generate_prepare, or the /tokenize / /apply-template / /detokenize body), and the result comes
// back through the server's eventfd to the loop, which answers or submits to the engine.
//
// Threads: a job is touched by the loop until queued, by one worker until it is on the done list,
// then by the loop again. The connection's close callback (loop) marks a job whose client left,
// and the loop then drops its result. Workers read only what does not change while serving (the
// engine table, limits, model names) and are joined when the event loop ends, before the engine
// is freed.
#include <event2/buffer.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "server/server_internal.h"

#define SERVER_OFFLOAD_BYTES (256u << 10)

struct srv_job {
    struct server *srv;
    enum srv_job_kind kind;
    enum oai_endpoint ep;
    struct http_req *req; // NULL once the client left
    struct evbuffer *body; // moved out of the request
    bool gone;
    struct srv_req *r; // JOB_GENERATE: the prepared request, or NULL with e
    struct oai_error e;
    int code; // the others: status and response text
    char *out;
    struct srv_job *next;
};

static void *worker_main(void *arg) {
    struct server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->work_mu);
        while (!s->work_stop && !s->job_head)
            pthread_cond_wait(&s->work_cv, &s->work_mu);
        struct srv_job *j = s->job_head;
        if (j) {
            s->job_head = j->next;
            if (!s->job_head) s->job_tail = NULL;
        }
        pthread_mutex_unlock(&s->work_mu);
        if (!j) return NULL; // stopping, nothing queued
        size_t len = evbuffer_get_length(j->body);
        const char *body = len ? (const char *)evbuffer_pullup(j->body, -1) : "";
        switch (j->kind) {
        case JOB_GENERATE:
            j->r = generate_prepare(s, j->ep, body, len, &j->e);
            break;
        case JOB_TOKENIZE:
            j->code = server_tokenize_compute(s, body, len, false, &j->out);
            break;
        case JOB_TEMPLATE:
            j->code = server_tokenize_compute(s, body, len, true, &j->out);
            break;
        case JOB_DETOKENIZE:
            j->code = server_detokenize_compute(s, body, len, &j->out);
            break;
        }
        evbuffer_free(j->body);
        j->body = NULL;
        pthread_mutex_lock(&s->mu);
        bool was_empty = s->done_head == NULL && s->ready_head == NULL;
        j->next = NULL;
        if (s->done_tail)
            s->done_tail->next = j;
        else
            s->done_head = j;
        s->done_tail = j;
        pthread_mutex_unlock(&s->mu);
        if (was_empty) {
            uint64_t one = 1;
            ssize_t w = write(s->wake_fd, &one, sizeof one); // EAGAIN: the loop wakes anyway
            (void)w;
        }
    }
}

static void on_job_conn_close(struct http_req *req, void *arg) {
    struct srv_job *j = arg;
    j->gone = true;
    j->req = NULL; // the transport frees the request after this callback
}

bool server_offload(struct server *s, struct http_req *req, enum srv_job_kind kind, enum oai_endpoint ep) {
    struct evbuffer *in = http_req_body_buffer(req);
    if (s->n_workers == 0 || evbuffer_get_length(in) < SERVER_OFFLOAD_BYTES) return false;
    struct srv_job *j = xcalloc(1, sizeof *j);
    j->srv = s;
    j->kind = kind;
    j->ep = ep;
    j->req = req;
    j->body = evbuffer_new();
    CHECK(j->body);
    CHECK(evbuffer_add_buffer(j->body, in) == 0); // moves the chains
    http_req_set_closecb(req, on_job_conn_close, j);
    s->n_jobs++;
    pthread_mutex_lock(&s->work_mu);
    if (s->job_tail)
        s->job_tail->next = j;
    else
        s->job_head = j;
    s->job_tail = j;
    pthread_cond_signal(&s->work_cv);
    pthread_mutex_unlock(&s->work_mu);
    return true;
}

void server_jobs_finish(struct server *s, struct srv_job *list) {
    while (list) {
        struct srv_job *j = list;
        list = j->next;
        s->n_jobs--;
        if (!j->gone) {
            http_req_set_closecb(j->req, NULL, NULL);
            if (j->kind == JOB_GENERATE) {
                if (j->r)
                    generate_submit(s, j->req, j->ep, j->r);
                else
                    server_send_error(s, j->req, &j->e);
                j->r = NULL;
            } else {
                server_send_text(s, j->req, j->code, j->out);
                j->out = NULL;
            }
        }
        if (j->r) srv_req_unref(j->r);
        free(j->out);
        if (j->body) evbuffer_free(j->body);
        free(j);
    }
}

void server_workers_start(struct server *s) {
    pthread_mutex_init(&s->work_mu, NULL);
    pthread_cond_init(&s->work_cv, NULL);
    s->work_init = true;
    for (int i = 0; i < SERVER_WORKERS; i++) {
        if (pthread_create(&s->workers[i], NULL, worker_main, s) != 0) {
            LOG_WARN("cannot start a worker thread; large requests are handled on the event loop");
            break;
        }
        s->n_workers++;
    }
}

void server_workers_stop(struct server *s) {
    if (!s->work_init) return;
    pthread_mutex_lock(&s->work_mu);
    s->work_stop = true;
    pthread_cond_broadcast(&s->work_cv);
    pthread_mutex_unlock(&s->work_mu);
    for (int i = 0; i < s->n_workers; i++)
        pthread_join(s->workers[i], NULL);
    s->n_workers = 0;
    // Jobs queued but never started (only when the loop was stopped at once) and results not
    // applied yet: their connections are closed when the server is freed; drop the work.
    for (struct srv_job *j = s->job_head, *n; j; j = n) {
        n = j->next;
        j->next = NULL;
        pthread_mutex_lock(&s->mu);
        if (s->done_tail)
            s->done_tail->next = j;
        else
            s->done_head = j;
        s->done_tail = j;
        pthread_mutex_unlock(&s->mu);
    }
    s->job_head = s->job_tail = NULL;
}

void server_workers_free(struct server *s) {
    if (!s->work_init) return;
    pthread_mutex_lock(&s->mu);
    struct srv_job *list = s->done_head;
    s->done_head = s->done_tail = NULL;
    pthread_mutex_unlock(&s->mu);
    for (struct srv_job *j = list; j; j = j->next) {
        if (j->req && !j->gone) http_req_set_closecb(j->req, NULL, NULL);
        j->gone = true;
    }
    server_jobs_finish(s, list);
    pthread_cond_destroy(&s->work_cv);
    pthread_mutex_destroy(&s->work_mu);
    s->work_init = false;
}
