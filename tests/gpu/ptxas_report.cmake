# ptxas's report on one CUDA source of the library, compiled as the library compiles it (host-only:
# nvcc, no device). Fails on a spill not listed in ALLOWED, or larger than listed there, and on any
# wgmma serialization report (C75xx): regressions a benchmark would show only as lost time.
#
#   cmake -DNVCC=nvcc -DSOURCE=file.cu -DOBJECT=out.o -DARGS=a|b|c -DALLOWED=fn:stores:loads|...
#         -P ptxas_report.cmake
# Lists travel with `|` for `;` (add_test splits arguments at semicolons). ALLOWED: a substring of
# the mangled function name and the spill bytes ptxas may report for it.
foreach(var NVCC SOURCE OBJECT ARGS)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "ptxas_report.cmake: -D${var}=... is required")
  endif()
endforeach()
string(REPLACE "|" ";" args "${ARGS}")
string(REPLACE "|" ";" allowed "${ALLOWED}")

execute_process(COMMAND ${NVCC} ${args} -Xptxas -v -c ${SOURCE} -o ${OBJECT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE report)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "nvcc failed on ${SOURCE} (exit ${rc}):\n${out}\n${report}")
endif()

# One report line a list element: brackets (`cmem[0]`) would keep CMake from splitting at `;`.
string(REPLACE "[" "(" report_lines "${report}")
string(REPLACE "]" ")" report_lines "${report_lines}")
string(REPLACE "\n" ";" report_lines "${report_lines}")
set(problems "")
set(function "")
set(functions 0)
foreach(line IN LISTS report_lines)
  if(line MATCHES "Function properties for ([^ ]+)")
    set(function "${CMAKE_MATCH_1}")
    math(EXPR functions "${functions} + 1")
  elseif(line MATCHES "([0-9]+) bytes spill stores, ([0-9]+) bytes spill loads")
    set(stores ${CMAKE_MATCH_1})
    set(loads ${CMAKE_MATCH_2})
    if(stores GREATER 0 OR loads GREATER 0)
      set(limit_stores 0)
      set(limit_loads 0)
      foreach(entry IN LISTS allowed)
        string(REPLACE ":" ";" entry "${entry}")
        list(GET entry 0 pattern)
        string(FIND "${function}" "${pattern}" at)
        if(at GREATER -1)
          list(GET entry 1 limit_stores)
          list(GET entry 2 limit_loads)
        endif()
      endforeach()
      if(stores GREATER limit_stores OR loads GREATER limit_loads)
        string(APPEND problems "  ${function}: ${stores} bytes spill stores, ${loads} bytes spill loads "
                               "(allowed: ${limit_stores}, ${limit_loads})\n")
      endif()
    endif()
  elseif(line MATCHES "\\(C75[0-9][0-9]\\)")
    string(APPEND problems "  ${line}\n")
  endif()
endforeach()

if(functions EQUAL 0)
  message(FATAL_ERROR "no `Function properties` lines in ptxas's report on ${SOURCE}:\n${report}")
endif()
if(NOT problems STREQUAL "")
  message(FATAL_ERROR "ptxas on ${SOURCE}:\n${problems}")
endif()
message(STATUS "ptxas on ${SOURCE}: ${functions} functions, no spill beyond the allowed ones, no wgmma serialization")
