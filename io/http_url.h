// The URLs of the HTTP services training talks to (a Prometheus Pushgateway,
// an MLflow tracking server) split the way cpp-httplib's client takes them:
// "http://host:9091/prefix/" → base "http://host:9091", prefix "/prefix".
// One parser so that every flag taking a URL refuses the same mistakes with
// the same kind of message.
#pragma once

#include <string>

namespace tessera::io {

struct HttpUrl {
  std::string base;    // scheme://host[:port]
  std::string prefix;  // "" or "/path" without a trailing slash
};

// Throws tessera::Error naming `flag` and showing `example` when `url` is not
// http:// (or https:// where `allow_https`) followed by a host.
HttpUrl parse_http_url(const std::string& url, const std::string& flag, const std::string& example,
                       bool allow_https = false);

}  // namespace tessera::io
