# atomc build. CPU-only by default; `make CUDA=1` adds the CUDA backend (sm_90a).
#   make            -> build/atomc and build/libatomc.a
#   make test       -> every CPU test (C unit tests + Python reference tests), closing "N passed, N failed, N skipped"
#   make asan       -> the same tests built with ASan/UBSan (build-asan/)
#   make CUDA=1     -> build-cuda/atomc with the CUDA backend; `make CUDA=1 gpu-tests` builds GPU tests
#   make fuzz       -> libFuzzer targets (clang) in build-fuzz/
# Sources are discovered by wildcard: drop a .c under src/ and a tests/test_*.c and they build.

CUDA ?= 0
SANITIZE ?= 0
STATIC ?= 0

ifeq ($(CUDA),1)
  BUILD ?= build-cuda
else ifeq ($(SANITIZE),1)
  BUILD ?= build-asan
else
  BUILD ?= build
endif

CC ?= gcc
NVCC ?= nvcc
PKGS := libevent libevent_pthreads jansson libpcre2-8 libutf8proc libxxhash openblas
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS := $(shell pkg-config --libs $(PKGS) 2>/dev/null)

OPT ?= -O2
# The HTTP/1.1 request parser: llhttp 8.1.0 (Node.js's, MIT), whose generated C sources Debian's
# node-llhttp ships (scripts/setup.sh installs it); compiled into the library, not copied here.
LLHTTP_SRC_DIR := /usr/share/llhttp
LLHTTP_INC := /usr/share/include/llhttp
LLHTTP_C := api.c http.c llhttp.c
CFLAGS_BASE := -std=c11 $(OPT) -g -Wall -Wextra -Werror -Wno-unused-parameter -D_GNU_SOURCE \
  -Iinclude -Isrc -isystem $(LLHTTP_INC) $(PKG_CFLAGS) -pthread -fno-strict-aliasing
ifeq ($(SANITIZE),1)
  CFLAGS_BASE += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
  LDFLAGS_SAN := -fsanitize=address,undefined
endif
CFLAGS := $(CFLAGS_BASE) $(EXTRA_CFLAGS)
# The grammar engine (structured output): xgrammar's C++ core as a static library built by
# scripts/build_xgrammar.sh into third_party/ (outside git, kept by `make clean`); only
# src/grammar/xgr_shim.cc includes its headers.
XGR_DIR := third_party/xgrammar-0.2.8
XGR_LIB := $(XGR_DIR)/build/libxgrammar.a
CXX ?= g++
CXXFLAGS := -std=c++17 $(OPT) -g -Wall -Wextra -Werror -Wno-unused-parameter -Iinclude -Isrc \
  -isystem $(XGR_DIR)/src/include -isystem $(XGR_DIR)/src/3rdparty/dlpack/include -pthread $(EXTRA_CXXFLAGS)
ifeq ($(SANITIZE),1)
  CXXFLAGS += -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
endif
LDLIBS := $(PKG_LIBS) $(XGR_LIB) -lstdc++ -lm -lpthread -ldl

SRC_C := $(shell find src -name '*.c' -not -path 'src/cli/*' | sort)
# Assembler sources: only src/server/webui_embed.S, which .incbin's the chat page.
SRC_S := $(shell find src -name '*.S' | sort)
SRC_CC := $(shell find src -name '*.cc' | sort)
CLI_C := $(shell find src/cli -name '*.c' | sort)
TEST_C := $(sort $(wildcard tests/test_*.c))
TEST_SUPPORT_C := $(filter-out $(TEST_C),$(wildcard tests/*.c))

ifeq ($(CUDA),1)
  CUDA_HOME ?= /usr/local/cuda
  CU_SRC := $(shell find src/backend/cuda src/parallel -name '*.cu' | sort)
  CU_OBJ := $(patsubst %.cu,$(BUILD)/%.o,$(CU_SRC))
  CFLAGS += -DATOMC_CUDA=1 -I$(CUDA_HOME)/include
  # -gencode (not -arch=sm_90a): nvcc 13.0's shorthand also runs a plain sm_90 pass.
  NVCCFLAGS ?= -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -lineinfo -Iinclude -Isrc \
    -Xcompiler -fPIC,-Wall,-Wextra,-Wno-unused-parameter,-Wno-missing-field-initializers -Werror all-warnings --expt-relaxed-constexpr -DATOMC_CUDA=1
  # Debian libraries static, CUDA runtime static, cuBLASLt/NCCL dynamic (DESIGN.md section 4).
  LDLIBS := -Wl,-Bstatic -levent -levent_pthreads -ljansson -lpcre2-8 -lutf8proc -lxxhash -lopenblas -lgfortran -lquadmath \
    -Wl,-Bdynamic -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart_static -lcublasLt -lnccl \
    $(XGR_LIB) -lrt -lm -lpthread -ldl -lstdc++
  LINK := $(CC)
  GPU_TEST_CU := $(sort $(wildcard tests/gpu/test_*.c))
  GPU_BENCH_C := $(sort $(wildcard bench/gpu_*.c))
else
  CU_OBJ :=
endif

LLHTTP_OBJ := $(patsubst %.c,$(BUILD)/llhttp/llhttp_%.o,$(LLHTTP_C)) # (distinct member names in the archive)
OBJ := $(LLHTTP_OBJ) $(patsubst %.c,$(BUILD)/%.o,$(SRC_C)) $(patsubst %.S,$(BUILD)/%.o,$(SRC_S)) $(patsubst %.cc,$(BUILD)/%.o,$(SRC_CC)) $(CU_OBJ)
CLI_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(CLI_C))
TEST_BIN := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_C))
TEST_SUPPORT_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(TEST_SUPPORT_C))
GPU_TEST_BIN := $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(GPU_TEST_CU))
GPU_BENCH_BIN := $(patsubst bench/%.c,$(BUILD)/bench/%,$(GPU_BENCH_C))

.PHONY: all test asan clean fuzz gpu-tests gpu-test format bench
.SECONDARY:
all: $(BUILD)/atomc $(BUILD)/libatomc.a $(TEST_BIN)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/llhttp/llhttp_%.o: $(LLHTTP_SRC_DIR)/%.c
	@mkdir -p $(dir $@)
	$(CC) -std=c11 $(OPT) -g -w -isystem $(LLHTTP_INC) $(LDFLAGS_SAN) -c $< -o $@

$(BUILD)/%.o: %.S
	@mkdir -p $(dir $@)
	$(CC) -c $< -o $@
$(BUILD)/src/server/webui_embed.o: src/server/webui/index.html
$(BUILD)/%.o: %.cc | $(XGR_LIB)
	@mkdir -p $(dir $@)
	$(CXX) $(CXXFLAGS) -MMD -MP -c $< -o $@

$(XGR_LIB):
	bash scripts/build_xgrammar.sh

$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libatomc.a: $(OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/atomc: $(CLI_OBJ) $(BUILD)/libatomc.a $(XGR_LIB)
	$(CC) $(LDFLAGS_SAN) -o $@ $(CLI_OBJ) $(BUILD)/libatomc.a $(LDLIBS)

$(BUILD)/tests/%: tests/%.c $(TEST_SUPPORT_OBJ) $(BUILD)/libatomc.a $(XGR_LIB)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -Itests -o $@ $< $(TEST_SUPPORT_OBJ) $(BUILD)/libatomc.a $(LDLIBS) $(LDFLAGS_SAN)

# GPU tests (tests/gpu/test_*.c) and kernel benchmarks (bench/gpu_*.c): C programs linked
# with the CUDA build; they run only on the GPU machine (`make CUDA=1 gpu-test` there).
gpu-tests: $(GPU_TEST_BIN) $(GPU_BENCH_BIN) $(BUILD)/atomc
$(BUILD)/tests/gpu/%: tests/gpu/%.c $(TEST_SUPPORT_OBJ) $(BUILD)/libatomc.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -Itests -o $@ $< $(TEST_SUPPORT_OBJ) $(BUILD)/libatomc.a $(LDLIBS)
gpu-test: gpu-tests
	@for t in $(GPU_TEST_BIN); do echo "== $$t"; $$t || exit 1; done

# Benchmark programs: bench/*.c, each linked with the library (make bench).
BENCH_C := $(wildcard bench/*.c)
bench: $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_C))
$(BUILD)/bench/%: bench/%.c $(BUILD)/libatomc.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -o $@ $< $(BUILD)/libatomc.a $(LDLIBS) $(LDFLAGS_SAN)

test: all
	ATOMC_BUILD=$(BUILD) bash tests/run_all.sh

asan:
	$(MAKE) SANITIZE=1 all
	ATOMC_BUILD=build-asan ATOMC_SKIP_PY=1 bash tests/run_all.sh

# libFuzzer targets: fuzz/fuzz_*.c, each linked with the library built under clang.
FUZZ_C := $(wildcard fuzz/fuzz_*.c)
fuzz:
	$(MAKE) BUILD=build-fuzz CC=clang EXTRA_CFLAGS="-fsanitize=fuzzer-no-link,address,undefined" $(patsubst %.c,build-fuzz/%.o,$(SRC_C)) $(patsubst %.S,build-fuzz/%.o,$(SRC_S)) $(patsubst %.cc,build-fuzz/%.o,$(SRC_CC)) build-fuzz/libatomc.a
	@mkdir -p build-fuzz/fuzz
	for f in $(FUZZ_C); do \
	  clang $(CFLAGS_BASE) -Wno-error -fsanitize=fuzzer,address,undefined -o build-fuzz/fuzz/$$(basename $$f .c) $$f build-fuzz/libatomc.a $(LDLIBS) || exit 1; \
	done

format:
	clang-format -i $$(find src include tests fuzz -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh')

clean:
	rm -rf build build-asan build-cuda build-fuzz

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
