// A program with one deliberate bug, registered only in sanitizer builds
// (SHARC_SANITIZE=ON): its test passes only if the sanitizer reports the bug,
// which proves the instrumentation is really on.

#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

int main(int argc, char** argv) {
  const bool overflow = argc > 1 && std::strcmp(argv[1], "heap") == 0;
  if (overflow) {
    std::vector<int> v(4);
    volatile int* data = v.data();
    std::printf("%d\n", data[v.size()]);  // one past the end: ASan heap-buffer-overflow
  } else {
    volatile int big = std::numeric_limits<int>::max();
    std::printf("%d\n", big + argc);  // UBSan: signed integer overflow
  }
  return 0;
}
