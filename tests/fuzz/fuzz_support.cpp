// The fuzz harnesses' shared scratch directory, exception policy helpers and
// HDF5 builders (fuzz_support.h).
#include "fuzz_support.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <system_error>

#include "io/hdf5_file.h"

namespace tessera::fuzz {
namespace {

// Removes the scratch directory when the process exits normally (after a
// finding libFuzzer exits without running destructors: $TMPDIR, set by the
// CTest runner to the test's own directory, keeps the leftovers contained).
struct ScratchDir {
  fs::path path;
  ScratchDir() {
    std::string pattern = (fs::temp_directory_path() / "tessera-fuzz-XXXXXX").string();
    if (!mkdtemp(pattern.data())) throw std::runtime_error("fuzz: cannot create a scratch directory in $TMPDIR");
    path = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    fs::remove_all(path, ignored);
  }
};

// HDF5 prints its error stack on every failed call unless told not to; the
// builders probe and fail on purpose, and the readers quiet their own calls.
struct Hdf5Silence {
  Hdf5Silence() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};
const Hdf5Silence hdf5_silence;

io::Hdf5Handle owned_type(ElementType type) {
  hid_t predefined = H5T_STD_U8LE;
  switch (type) {
    case ElementType::u8:
      predefined = H5T_STD_U8LE;
      break;
    case ElementType::i8:
      predefined = H5T_STD_I8LE;
      break;
    case ElementType::u16:
      predefined = H5T_STD_U16LE;
      break;
    case ElementType::i16:
      predefined = H5T_STD_I16LE;
      break;
    case ElementType::u32:
      predefined = H5T_STD_U32LE;
      break;
    case ElementType::i32:
      predefined = H5T_STD_I32LE;
      break;
    case ElementType::u64:
      predefined = H5T_STD_U64LE;
      break;
    case ElementType::i64:
      predefined = H5T_STD_I64LE;
      break;
    case ElementType::i64_be:
      predefined = H5T_STD_I64BE;
      break;
    case ElementType::f32:
      predefined = H5T_IEEE_F32LE;
      break;
    case ElementType::f64:
      predefined = H5T_IEEE_F64LE;
      break;
    case ElementType::fixed_string:
      predefined = H5T_C_S1;
      break;
    case ElementType::kCount:
      break;
  }
  io::Hdf5Handle copy = io::datatype_handle(H5Tcopy(predefined));
  if (type == ElementType::fixed_string) H5Tset_size(copy.get(), 8);
  return copy;
}

ElementType any_type(FuzzedDataProvider& data) {
  return ElementType(data.ConsumeIntegralInRange<int>(0, int(ElementType::kCount) - 1));
}

// Writes one attribute; a name that already exists or a type HDF5 refuses
// leaves the attribute out (the builders need not be exact).
void put_attribute(hid_t object, const char* name, hid_t type, hid_t space, const void* value) {
  io::Hdf5Handle attribute = io::attribute_handle(H5Acreate2(object, name, type, space, H5P_DEFAULT, H5P_DEFAULT));
  if (attribute.valid() && value) H5Awrite(attribute.get(), type, value);
}

io::Hdf5Handle scalar_space() {
  return io::dataspace_handle(H5Screate(H5S_SCALAR));
}

io::Hdf5Handle vector_space(hsize_t count) {
  return io::dataspace_handle(H5Screate_simple(1, &count, nullptr));
}

io::Hdf5Handle string_type(size_t size, H5T_str_t pad, H5T_cset_t cset = H5T_CSET_ASCII) {
  io::Hdf5Handle type = io::datatype_handle(H5Tcopy(H5T_C_S1));
  H5Tset_size(type.get(), size);
  H5Tset_strpad(type.get(), pad);
  H5Tset_cset(type.get(), cset);
  return type;
}

void put_fixed_string(hid_t object, const char* name, const std::string& text, H5T_str_t pad, size_t size,
                      H5T_cset_t cset = H5T_CSET_ASCII) {
  std::string buffer = text;
  buffer.resize(std::max<size_t>(size, 1), pad == H5T_STR_SPACEPAD ? ' ' : '\0');
  io::Hdf5Handle type = string_type(std::max<size_t>(size, 1), pad, cset);
  io::Hdf5Handle space = scalar_space();
  put_attribute(object, name, type.get(), space.get(), buffer.data());
}

void put_variable_string(hid_t object, const char* name, const char* text) {
  io::Hdf5Handle type = string_type(H5T_VARIABLE, H5T_STR_NULLTERM);
  io::Hdf5Handle space = scalar_space();
  put_attribute(object, name, type.get(), space.get(), &text);
}

size_t element_count(const std::vector<hsize_t>& dims) {
  size_t count = 1;
  for (hsize_t dim : dims) count *= size_t(dim);
  return count;
}

// Dims of at most 5 dimensions and 4096 elements.
std::vector<hsize_t> any_small_dims(FuzzedDataProvider& data) {
  std::vector<hsize_t> dims(size_t(data.ConsumeIntegralInRange<int>(0, 5)));
  size_t count = 1;
  for (hsize_t& dim : dims) {
    dim = data.ConsumeIntegralInRange<hsize_t>(0, 16);
    if (count * std::max<hsize_t>(dim, 1) > 4096) dim = 1;
    count *= std::max<hsize_t>(dim, 1);
  }
  return dims;
}

}  // namespace

const fs::path& fresh_scratch_dir() {
  static const ScratchDir scratch;
  for (const fs::directory_entry& entry : fs::directory_iterator(scratch.path)) fs::remove_all(entry.path());
  return scratch.path;
}

void write_file(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  if (!out) throw std::runtime_error("fuzz: cannot write " + path.string());
}

void write_file(const fs::path& path, const std::vector<uint8_t>& bytes) {
  write_file(path, std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

void maybe_truncate(FuzzedDataProvider& data, const fs::path& path) {
  if (data.ConsumeIntegralInRange<int>(0, 7) != 7) return;
  const uintmax_t size = fs::file_size(path);
  if (size == 0) return;
  fs::resize_file(path, data.ConsumeIntegralInRange<uintmax_t>(0, size - 1));
}

int64_t interesting_int(FuzzedDataProvider& data) {
  static constexpr int64_t kValues[] = {0,
                                        1,
                                        -1,
                                        2,
                                        255,
                                        256,
                                        65535,
                                        65536,
                                        int64_t(1) << 31,
                                        (int64_t(1) << 31) - 1,
                                        (int64_t(1) << 31) + 1,
                                        int64_t(1) << 32,
                                        int64_t(1) << 62,
                                        std::numeric_limits<int64_t>::max(),
                                        std::numeric_limits<int64_t>::min()};
  const size_t choice = data.ConsumeIntegralInRange<size_t>(0, std::size(kValues));
  return choice < std::size(kValues) ? kValues[choice] : data.ConsumeIntegral<int64_t>();
}

bool is_string(ElementType type) {
  return type == ElementType::fixed_string;
}

void fuzz_int_attribute(FuzzedDataProvider& data, hid_t object, const char* name, int64_t valid) {
  switch (data.ConsumeIntegralInRange<int>(0, 10)) {
    case 0:
    case 1: {
      const int64_t value = data.ConsumeBool() ? valid : interesting_int(data);
      io::Hdf5Handle space = scalar_space();
      put_attribute(object, name, H5T_STD_I64LE, space.get(), &value);
      return;
    }
    case 2:
      return;  // missing
    case 3: {
      const auto value = uint64_t(interesting_int(data));
      io::Hdf5Handle space = scalar_space();
      put_attribute(object, name, H5T_STD_U64LE, space.get(), &value);
      return;
    }
    case 4: {
      const auto value = int32_t(data.ConsumeBool() ? valid : interesting_int(data));
      io::Hdf5Handle space = scalar_space();
      put_attribute(object, name, H5T_STD_I32BE, space.get(), &value);
      return;
    }
    case 5: {
      const auto value = uint8_t(valid);
      io::Hdf5Handle space = scalar_space();
      put_attribute(object, name, H5T_STD_U8LE, space.get(), &value);
      return;
    }
    case 6: {
      const double value = data.ConsumeBool() ? double(valid) + 0.5 : data.ConsumeFloatingPoint<double>();
      io::Hdf5Handle space = scalar_space();
      put_attribute(object, name, H5T_IEEE_F64LE, space.get(), &value);
      return;
    }
    case 7:
      put_fixed_string(object, name, std::to_string(valid), H5T_STR_NULLTERM, std::to_string(valid).size() + 1);
      return;
    case 8: {
      const int64_t values[2] = {valid, interesting_int(data)};
      io::Hdf5Handle space = vector_space(2);
      put_attribute(object, name, H5T_STD_I64LE, space.get(), values);
      return;
    }
    case 9: {
      io::Hdf5Handle space = io::dataspace_handle(H5Screate(H5S_NULL));
      put_attribute(object, name, H5T_STD_I64LE, space.get(), nullptr);
      return;
    }
    default: {  // a one-element array instead of a scalar
      io::Hdf5Handle space = vector_space(1);
      put_attribute(object, name, H5T_STD_I64LE, space.get(), &valid);
      return;
    }
  }
}

void fuzz_string_attribute(FuzzedDataProvider& data, hid_t object, const char* name, std::string_view valid) {
  const std::string text(valid);
  switch (data.ConsumeIntegralInRange<int>(0, 11)) {
    case 0:
      put_fixed_string(object, name, text, H5T_STR_NULLTERM, text.size() + 1);
      return;
    case 1:
      put_variable_string(object, name, text.c_str());
      return;
    case 2: {
      const std::string other = data.ConsumeRandomLengthString(64);
      put_fixed_string(object, name, other, H5T_STR_NULLTERM, other.size() + 1);
      return;
    }
    case 3: {
      const std::string other = data.ConsumeRandomLengthString(64);
      put_variable_string(object, name, other.c_str());
      return;
    }
    case 4:
      return;  // missing
    case 5:
      put_fixed_string(object, name, text, H5T_STR_NULLPAD, text.size());  // no terminator
      return;
    case 6:
      put_fixed_string(object, name, text, H5T_STR_SPACEPAD, text.size() + 3);
      return;
    case 7: {
      const int64_t value = interesting_int(data);
      io::Hdf5Handle space = scalar_space();
      put_attribute(object, name, H5T_STD_I64LE, space.get(), &value);
      return;
    }
    case 8: {
      std::string both = text + '\0' + text + '\0';
      io::Hdf5Handle type = string_type(text.size() + 1, H5T_STR_NULLTERM);
      io::Hdf5Handle space = vector_space(2);
      put_attribute(object, name, type.get(), space.get(), both.data());
      return;
    }
    case 9:
      put_variable_string(object, name, nullptr);  // a NULL variable-length string
      return;
    case 10:
      put_fixed_string(object, name, text + '\0' + "tail", H5T_STR_NULLTERM, text.size() + 6);
      return;
    default:
      put_fixed_string(object, name, text, H5T_STR_NULLTERM, text.size() + 1, H5T_CSET_UTF8);
      return;
  }
}

std::vector<uint8_t> fuzz_dataset(FuzzedDataProvider& data, hid_t group, const char* name, const DatasetSpec& valid) {
  enum Form { kValid, kOtherType, kOtherShape, kOutOfRange, kHuge, kGroup, kDanglingLink, kMissing, kFormCount };
  const auto form = Form(data.ConsumeIntegralInRange<int>(0, kFormCount - 1));
  if (form == kMissing) return {};
  if (form == kGroup) {
    io::Hdf5Handle made(H5Gcreate2(group, name, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose);
    return {};
  }
  if (form == kDanglingLink) {
    H5Lcreate_soft("/nowhere", group, name, H5P_DEFAULT, H5P_DEFAULT);
    return {};
  }

  ElementType element = form == kOtherType ? any_type(data) : valid.type;
  std::vector<hsize_t> dims = form == kOtherShape ? any_small_dims(data) : valid.dims;
  if (form == kHuge) {
    if (dims.empty()) dims.push_back(1);
    dims[0] = hsize_t(1) << data.ConsumeIntegralInRange<int>(20, 62);
  }
  io::Hdf5Handle type = owned_type(element);
  const size_t element_size = H5Tget_size(type.get());
  const size_t count = form == kHuge ? 0 : element_count(dims);

  // Storage layout: contiguous, chunked, chunked and compressed, or compact.
  io::Hdf5Handle create = io::property_list_handle(H5Pcreate(H5P_DATASET_CREATE));
  int layout = form == kHuge ? 1 : data.ConsumeIntegralInRange<int>(0, 3);
  if (dims.empty() && (layout == 1 || layout == 2)) layout = 0;  // a scalar cannot be chunked
  if (layout == 3 && count * element_size > 32000) layout = 0;
  if (layout == 1 || layout == 2) {
    std::vector<hsize_t> chunk(dims.size());
    for (size_t i = 0; i < dims.size(); ++i)
      chunk[i] = std::clamp<hsize_t>(data.ConsumeIntegralInRange<hsize_t>(1, 64), 1, std::max<hsize_t>(dims[i], 1));
    if (form == kHuge) chunk.assign(dims.size(), 1);
    H5Pset_chunk(create.get(), int(chunk.size()), chunk.data());
    if (layout == 2) H5Pset_deflate(create.get(), 1);
  } else if (layout == 3) {
    H5Pset_layout(create.get(), H5D_COMPACT);
  }
  io::Hdf5Handle space = io::dataspace_handle(dims.empty() ? H5Screate(H5S_SCALAR)
                                                           : H5Screate_simple(int(dims.size()), dims.data(), nullptr));
  io::Hdf5Handle dataset =
      io::dataset_handle(H5Dcreate2(group, name, type.get(), space.get(), H5P_DEFAULT, create.get(), H5P_DEFAULT));
  if (!dataset.valid() || form == kHuge || count == 0 || is_string(element)) return {};

  // Values: in [0, value_bound) unless out of range was chosen; HDF5
  // converts them to the file's type.
  const std::vector<uint8_t> bytes = data.ConsumeBytes<uint8_t>(count);
  const bool integer = H5Tget_class(type.get()) == H5T_INTEGER;
  std::vector<int64_t> integers(count, 0);
  std::vector<double> floats(count, 0.0);
  for (size_t i = 0; i < count; ++i) {
    const int64_t byte = i < bytes.size() ? bytes[i] : 0;
    int64_t value = valid.value_bound > 0 ? byte % valid.value_bound : byte;
    if (form == kOutOfRange && (i == 0 || byte >= 128)) value = interesting_int(data);
    integers[i] = value;
    floats[i] = double(value);
  }
  if (H5Dwrite(dataset.get(), integer ? H5T_NATIVE_INT64 : H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT,
               integer ? static_cast<const void*>(integers.data()) : static_cast<const void*>(floats.data())) < 0)
    return {};
  std::vector<uint8_t> stored(count * element_size);
  if (H5Dread(dataset.get(), type.get(), H5S_ALL, H5S_ALL, H5P_DEFAULT, stored.data()) < 0) return {};
  return stored;
}

void write_dataset(hid_t group, const char* name, hid_t type, const std::vector<hsize_t>& dims, const void* bytes) {
  io::Hdf5Handle space = io::dataspace_handle(dims.empty() ? H5Screate(H5S_SCALAR)
                                                           : H5Screate_simple(int(dims.size()), dims.data(), nullptr));
  io::Hdf5Handle dataset =
      io::dataset_handle(H5Dcreate2(group, name, type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  if (dataset.valid() && element_count(dims) > 0) H5Dwrite(dataset.get(), type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes);
}

void check_hdf5_ids_closed() {
  const ssize_t open = H5Fget_obj_count(H5F_OBJ_ALL, H5F_OBJ_ALL);
  if (open != 0) {
    std::fprintf(stderr, "fuzz: %zd HDF5 ids are still open after the parser returned (a handle leak)\n", open);
    std::abort();
  }
}

hid_t create_file(const fs::path& path) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  if (file < 0) throw std::runtime_error("fuzz: cannot create " + path.string());
  return file;
}

}  // namespace tessera::fuzz
