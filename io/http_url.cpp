// parse_http_url (io/http_url.h).
#include "io/http_url.h"

#include "core/error.h"

namespace tessera::io {

HttpUrl parse_http_url(const std::string& url, const std::string& flag, const std::string& example,
                       bool allow_https) {
  const size_t scheme = url.find("://");
  const std::string name = scheme == std::string::npos ? "" : url.substr(0, scheme);
  const bool known = name == "http" || (allow_https && name == "https");
  TESSERA_CHECK(known && url.size() > scheme + 3 && url[scheme + 3] != '/', flag, " ", url, ": give the ",
                allow_https ? "http:// or https:// URL" : "http:// URL", ", e.g. ", example);
  const size_t path = url.find('/', scheme + 3);
  if (path == std::string::npos) return {url, ""};
  std::string prefix = url.substr(path);
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  return {url.substr(0, path), prefix};
}

}  // namespace tessera::io
