#!/usr/bin/env bash
# Does this host's g++ link libstdc++ statically, and does a second, static libstdc++ in a process
# that loaded the shared one crash at the first number formatted through a C++ stream? The suspected
# cause of llama.cpp's SIGSEGV on the lent H100 host (lab/results/issue42-h100/llamacpp-crash.md).
# ~20 s, no llama.cpp build needed. Through the device tool: run(command="bash lab/gpu/gpu_probe_libstdcxx.sh").
set -u
work=$(mktemp -d); cd "$work" || exit 1
cxx=${CXX:-g++}  # what CMake builds with: the GPU image sets CXX=/opt/gcc/bin/g++ (the cause, run 2)
for c in g++ "$cxx"; do echo "$c: $($c --version | head -1); libstdc++.so for the linker: $($c -print-file-name=libstdc++.so)"; done
ls -la /usr/lib/gcc/x86_64-linux-gnu/*/libstdc++* /usr/lib/x86_64-linux-gnu/libstdc++.so* 2>&1
dpkg -l 'libstdc++6' 'libstdc++-*-dev' 2>/dev/null | grep ^ii
env | grep -E '^(LDFLAGS|CXXFLAGS|CFLAGS|CXX|CC|CMAKE_ARGS|LD_LIBRARY_PATH)=' || echo "no compiler/linker env vars"
for f in /tmp/probe/s*/llama_cpp/lib/lib{llama,ggml-base}.so /tmp/site/llama_cpp/lib/lib{llama,ggml-base}.so; do
  [ -e "$f" ] && echo "$f: $(readelf -d "$f" | grep -o 'libstdc++[^]]*') num_put::id defined: $(nm -D --defined-only "$f" | grep -c 'num_put.*2idE')"
done
printf '%s\n' '#include <sstream>' '#include <cstdio>' \
  'extern "C" void f_str(){std::stringstream s; s<<"[abc]"; std::printf("str ok %s\n",s.str().c_str()); std::fflush(stdout);}' \
  'extern "C" void f_int(){std::stringstream s; s<<28; std::printf("int ok %s\n",s.str().c_str()); std::fflush(stdout);}' > t.cpp
printf '%s\n' 'import sys, ctypes, faulthandler; faulthandler.enable()' \
  'if sys.argv[2]=="stdcxx": ctypes.CDLL("libstdc++.so.6")' \
  'l=ctypes.CDLL(sys.argv[1]); l.f_str(); l.f_int(); print("done")' > run.py
"$cxx" -O2 -fPIC -shared t.cpp -o libt_dyn.so && echo "default link ($cxx) NEEDED: $(readelf -d libt_dyn.so | grep -o 'libstdc++[^]]*' || echo NONE)"
"$cxx" -O2 -fPIC -shared -static-libstdc++ -static-libgcc t.cpp -o libt_static.so
for l in dyn static; do
  for m in none stdcxx; do
    echo "== $l $m"; timeout 20 python3 run.py "./libt_$l.so" "$m" 2>&1 | head -3; echo "rc=${PIPESTATUS[0]}"
  done
done
rm -rf "$work"
