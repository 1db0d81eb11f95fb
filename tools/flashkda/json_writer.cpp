#include "json_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "args.h"

namespace flashkda::cli {

std::string dump_json(const Json& doc) {
  return doc.dump(2, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace) + "\n";
}

JsonFile::JsonFile(std::string path, const std::string& flag) : path_(std::move(path)) {
  // Create the file only when it does not exist, so that the destructor knows whether to remove
  // it; an existing one is opened without truncating it, so a failed run leaves it as it was.
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  if (fd_ >= 0)
    created_ = true;
  else if (errno == EEXIST)
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd_ < 0) throw UsageError(flag + ": cannot open '" + path_ + "' for writing: " + std::strerror(errno));
}

JsonFile::~JsonFile() {
  if (fd_ >= 0) ::close(fd_);
  if (created_ && !written_) ::unlink(path_.c_str());
}

void JsonFile::write(const Json& doc) {
  const std::string text = dump_json(doc);
  auto fail = [this](const char* what) {
    throw std::runtime_error("writing the JSON to '" + path_ + "' failed: " + what + ": " + std::strerror(errno));
  };
  if (fd_ < 0) {
    errno = EBADF;
    fail("the file is closed");
  }
  // Truncate regular files only: the path may also be a pipe or a terminal (/dev/stdout).
  struct stat st {};
  if (::fstat(fd_, &st) != 0) fail("fstat");
  if (S_ISREG(st.st_mode) && (::ftruncate(fd_, 0) != 0 || ::lseek(fd_, 0, SEEK_SET) != 0)) fail("truncate");
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write");
    }
    done += static_cast<size_t>(n);
  }
  written_ = true;
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close");
}

}  // namespace flashkda::cli
