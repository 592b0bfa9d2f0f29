# Every dependency found through find_package (config or module); no shell probes.
# Debian's packages are installed by scripts/install-deps.sh.
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(Threads REQUIRED)

# OpenBLAS: prefer the OpenMP build so OpenBLAS and our kernels share one
# thread pool (two pools on two cores oversubscribe the machine).
find_package(OpenBLAS CONFIG QUIET)
if(OpenBLAS_FOUND)
  add_library(tessera_openblas INTERFACE)
  target_include_directories(tessera_openblas SYSTEM INTERFACE ${OpenBLAS_INCLUDE_DIRS})
  target_link_libraries(tessera_openblas INTERFACE ${OpenBLAS_LIBRARIES})
else()
  set(BLA_VENDOR OpenBLAS)
  find_package(BLAS REQUIRED)
  find_path(OPENBLAS_CBLAS_INCLUDE_DIR cblas.h PATH_SUFFIXES openblas REQUIRED)
  add_library(tessera_openblas INTERFACE)
  target_include_directories(tessera_openblas SYSTEM INTERFACE ${OPENBLAS_CBLAS_INCLUDE_DIR})
  target_link_libraries(tessera_openblas INTERFACE BLAS::BLAS)
endif()

# oneDNN: bf16 matrix multiply on the CPU (AMX / AVX512_BF16 kernels).
find_package(dnnl CONFIG REQUIRED)

find_package(MPI REQUIRED COMPONENTS CXX)
find_package(HDF5 REQUIRED COMPONENTS C)
find_package(CLI11 CONFIG REQUIRED)
# toml++: the --config files of `tessera train` (apps/train_config.cpp).
find_package(tomlplusplus CONFIG REQUIRED)
find_package(nlohmann_json 3.2 CONFIG REQUIRED)  # JSON: safetensors headers, config.json
