// Subcommands of the atomc binary; each lives in src/cli/cmd_<name>.c and receives
// argv starting at the subcommand name.
#ifndef ATOMC_CLI_COMMANDS_H
#define ATOMC_CLI_COMMANDS_H

int cmd_version(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_chat_template(int argc, char **argv);
int cmd_bench_runner(int argc, char **argv);
int cmd_bench_serve(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_bench_throughput(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_bench_latency(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_proxy(int argc, char **argv);

#endif
