# Runs sharc-opt over a dumped schedule's IR with its dumped pipeline and
# checks it prints the dumped result again (ctest -R sharc_opt).
execute_process(COMMAND ${OPT} ${DATA}/replay.before.ir --pipeline-file ${DATA}/replay.pipeline
                OUTPUT_VARIABLE got ERROR_VARIABLE err RESULT_VARIABLE rc)
file(READ ${DATA}/replay.after.ir want)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "sharc-opt failed (${rc}): ${err}")
endif()
if(NOT got STREQUAL want)
  message(FATAL_ERROR "sharc-opt printed\n${got}\nbut the dump holds\n${want}")
endif()
